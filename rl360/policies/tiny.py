"""Tiny policies built from a config: a byte-level tokenizer with a ChatML tool-calling
template and a small Llama-shaped causal LM. Nothing is downloaded; tests and the CPU demo
use these, saved as ordinary HF directories so every loader path is the real one."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from rl360.policies.templates import CHATML_TOOLS

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# plain added tokens (not special): the tool-call markup is one token each, as in Qwen2.5
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


class TinyModelSpec(msgspec.Struct, forbid_unknown_fields=True):
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    vocab_size: int = 320
    seed: int = 0


# named shapes for "tiny:<preset>" model paths
TINY_PRESETS: dict[str, TinyModelSpec] = {
    "default": TinyModelSpec(),
    # the CPU demo's policy (~0.3M parameters)
    "demo": TinyModelSpec(hidden_size=96, intermediate_size=256, num_hidden_layers=3),
    # head_dim 32 (hidden / heads): the smallest vLLM's CPU attention runs (the presets above
    # have 16 and 24); engine parity tests serve it from every backend
    "parity": TinyModelSpec(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2),
    # ~113 MB of fp32 weights, for weight-sync benchmarks
    "sync100m": TinyModelSpec(hidden_size=768, intermediate_size=2048, num_hidden_layers=4,
                              num_attention_heads=12, num_key_value_heads=4),
}


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte <-> printable-unicode table used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def build_tiny_tokenizer() -> Any:
    """A byte-level tokenizer (one token per byte, no merges) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return _chat_tokenizer(tok)


def build_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE of at most `vocab_size` tokens (plus the chat tokens) trained on
    `texts`, with the same chat tokens and template as `build_tiny_tokenizer`. Any text still
    encodes (every byte is in the vocabulary); text like the training data takes a quarter of
    the tokens, so a tiny model copies a name as one or two tokens instead of ten bytes.
    Deterministic: the same texts give the same tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256:
        raise ValueError(f"BPE vocab_size {vocab_size} < 256: every byte needs a token")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    special = [*SPECIAL_TOKENS, *ADDED_TOKENS]

    def plain(text: str) -> str:  # chat markup is added tokens: keep it out of the merges
        for s in special:
            text = text.replace(s, "\n")
        return text

    tok.train_from_iterator((plain(t) for t in texts), trainer)
    return _chat_tokenizer(tok)


def _chat_tokenizer(tok: Any) -> Any:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS,
    )
    fast.add_tokens(ADDED_TOKENS)
    fast.chat_template = CHATML_TOOLS
    return fast


def build_tiny_model(spec: TinyModelSpec, tokenizer: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tiny model vocab_size {spec.vocab_size} < tokenizer size {len(tokenizer)}")
    cfg = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(cfg)
    return model.float().eval()


def save_tiny_policy(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a tiny policy as a standard HF directory (safetensors + tokenizer + template)."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(spec, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "rl360_tiny.json").write_text(json.dumps(msgspec.to_builtins(spec)))
    return out
