"""Supervised fine-tuning on chats (`rl360 sft`): warm-starts small policies before RL.

Data is a JSONL file of {"messages": [...]} chats or a "module:function" generator returning
such chats. Each chat is tokenized with the chat template exactly as the session server will
render it (each assistant turn's prompt = the messages before it, with the generation prompt);
the loss is the token-mean NLL of the assistant turns and their end-of-turn tokens (system,
user and tool messages are masked)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from rl360.policies.chat import ChatRenderer
from rl360.policies.loading import load_tokenizer, resolve_model_path
from rl360.policies.tiny import (
    TINY_PRESETS,
    TinyModelSpec,
    build_bpe_tokenizer,
    build_tiny_model,
    build_tiny_tokenizer,
)
from rl360.types import Message, ToolSpec

log = logging.getLogger("rl360.sft")


def load_chats(spec: str, n: int, seed: int) -> list[dict[str, Any]]:
    if spec.endswith(".jsonl"):
        with open(spec) as f:
            return [json.loads(line) for line in f if line.strip()]
    if ":" in spec:

        mod_name, _, fn_name = spec.rpartition(":")
        if mod_name.endswith(".py"):  # a script path, e.g. examples/demo/families.py
            s = importlib.util.spec_from_file_location(Path(mod_name).stem, mod_name)
            if s is None or s.loader is None:
                raise FileNotFoundError(f"sft.data {spec!r}: cannot load {mod_name}")
            mod = importlib.util.module_from_spec(s)
            sys.modules[s.name] = mod
            s.loader.exec_module(mod)
        else:
            mod = importlib.import_module(mod_name)
        return list(getattr(mod, fn_name)(n, seed))
    raise ValueError(f"sft.data {spec!r}: expected a .jsonl file or 'module:function'")


def _chat_parts(chat: dict[str, Any]) -> tuple[list[Any], list[Any] | None]:
    """A JSON chat's messages and tools (None when it lists none) as wire types."""

    msgs = [msgspec.convert(m, Message) for m in chat["messages"]]
    tools = [msgspec.convert(t, ToolSpec) for t in chat.get("tools") or ()] or None
    return msgs, tools


def _assistant_turn(renderer: Any, msgs: list[Message], tools: Any, i: int) -> tuple[str, str]:
    """(prompt text, trained text) of assistant message i: the prompt is the conversation before
    it with the generation prompt, as the session server renders it; the trained text is the
    turn as the chat template writes it (tool calls included) without the end-of-turn token."""
    prompt_text = renderer.render_text(msgs[:i], tools, add_generation_prompt=True)
    full_text = renderer.render_text(msgs[: i + 1], tools, add_generation_prompt=False)
    turn = full_text[len(prompt_text) :] if full_text.startswith(prompt_text) else ""
    end = renderer.tokenizer.convert_ids_to_tokens(renderer.end_of_turn_id)
    if msgs[i].tool_calls and end in turn:
        return prompt_text, turn[: turn.rindex(end)]
    return prompt_text, msgs[i].content or ""  # plain text: exactly the content


def encode_chat(renderer: Any, chat: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a chat: the loss covers every assistant turn (its text and tool
    calls, as the chat template writes them) and its end-of-turn token; the system prompt, the
    tools, user turns and tool results are context only (mask 0). The chat must end with an
    assistant message. A chat may list "tools" (OpenAI function specs), rendered into the
    prompt as an env would. A multi-turn chat is encoded piece by piece the way the session
    ledger grows: each assistant turn's prompt is the template's render of the conversation
    so far, so the text between two assistant turns (the junction after the end-of-turn
    token, the tool results, the next generation prompt) is the template's delta."""
    msgs, tools = _chat_parts(chat)
    if not msgs or msgs[-1].role != "assistant":
        raise ValueError("each SFT chat must end with an assistant message")
    end = renderer.tokenizer.convert_ids_to_tokens(renderer.end_of_turn_id)
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # the text encoded so far
    for i, m in enumerate(msgs):
        if m.role != "assistant":
            continue
        prompt_text, answer_text = _assistant_turn(renderer, msgs, tools, i)
        if not prompt_text.startswith(done):
            raise ValueError(f"the chat template does not render this chat append-only at "
                             f"message {i}: SFT cannot train on its earlier assistant turns")
        prompt = renderer.encode(prompt_text[len(done) :])
        answer = [*renderer.encode(answer_text), renderer.end_of_turn_id]
        ids += prompt + answer
        mask += [0] * len(prompt) + [1] * len(answer)
        done = prompt_text + answer_text + end
    return ids, mask


FINGERPRINT_FILE = "rl360_sft.txt"


def sft_fingerprint(cfg: Any, seed: int, chats: list[dict[str, Any]] | None = None) -> str:
    """A hash of the SFT section, the seed and the chats it trains on: a warm start made from
    other settings or other data (an edited generator) has another fingerprint."""

    if chats is None:
        chats = load_chats(cfg.data, cfg.samples, seed)
    h = hashlib.sha256(json.dumps([msgspec.to_builtins(cfg), seed], sort_keys=True).encode())
    for chat in chats:
        h.update(json.dumps(chat, sort_keys=True).encode())
    return h.hexdigest()


def warm_start_is_current(cfg: Any, seed: int) -> bool:
    """True when cfg.out holds a model that run_sft made from exactly these settings and data."""
    out = Path(cfg.out)
    stamp = out / FINGERPRINT_FILE
    if not (out / "config.json").is_file() or not stamp.is_file():
        return False
    return stamp.read_text().strip() == sft_fingerprint(cfg, seed)


def length_chunks(
    batch: list[tuple[list[int], list[int]]], max_tokens: int = 8192
) -> list[list[tuple[list[int], list[int]]]]:
    """The batch sorted by length and cut into chunks whose padded size (rows x longest) stays
    within max_tokens (a chunk holds at least one chat): a few long tool-use chats no longer
    pad every short one to their length."""
    chunks: list[list[tuple[list[int], list[int]]]] = []
    for item in sorted(batch, key=lambda b: len(b[0])):
        if chunks and (len(chunks[-1]) + 1) * len(item[0]) <= max_tokens:
            chunks[-1].append(item)
        else:
            chunks.append([item])
    return chunks


def backward_nll(model: Any, batch: list[tuple[list[int], list[int]]], pad: int) -> float:
    """Backpropagate the token-mean NLL of the batch's loss-masked tokens (accumulating into
    .grad) and return it. Runs chunk by chunk (`length_chunks`); the result is the one-batch
    token-mean exactly, each chunk scaled by the batch's target count."""
    import torch

    n_target = sum(sum(m[1:]) for _, m in batch)
    total = 0.0
    for chunk in length_chunks(batch):
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width))
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, (x, m) in enumerate(chunk):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
            attn[i, : len(x)] = 1
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        part = -(logp * mask[:, 1:]).sum() / max(n_target, 1)
        part.backward()
        total += float(part.detach())
    return total


def tiny_spec(base: str, init: dict[str, Any]) -> Any:
    """The TinyModelSpec of a "tiny[:preset]" base with `init`'s fields over it."""

    preset = base.partition(":")[2] or "default"
    if not (base == "tiny" or base.startswith("tiny:")) or preset not in TINY_PRESETS:
        raise ValueError(
            f"sft.tokenizer_vocab builds a fresh tiny model: sft.base must be 'tiny[:preset]' "
            f"(presets: {', '.join(sorted(TINY_PRESETS))}), got {base!r}"
        )
    fields = {**msgspec.to_builtins(TINY_PRESETS[preset]), **init}
    return msgspec.convert(fields, TinyModelSpec)


def chat_texts(chats: list[dict[str, Any]]) -> Iterator[str]:
    """Each chat as the chat template writes it, tools and tool calls included (what a
    tokenizer for these chats is trained on)."""

    renderer = ChatRenderer(build_tiny_tokenizer())
    for chat in chats:
        msgs, tools = _chat_parts(chat)
        yield renderer.render_text(msgs, tools, add_generation_prompt=False)


def run_sft(cfg: Any, seed: int = 0, chat_template: str = "auto") -> dict[str, float]:
    """cfg: the recipe's SftSection; chat_template: the recipe's `model.chat_template`, the
    template the session server will render the same chats with. Writes an HF model directory
    (its tokenizer carrying that template) to cfg.out."""
    import torch
    from transformers import AutoModelForCausalLM


    torch.manual_seed(seed)
    rng = random.Random(seed)
    chats = load_chats(cfg.data, cfg.samples, seed)
    if cfg.tokenizer_vocab:
        spec = tiny_spec(cfg.base, cfg.init)
        tok = build_bpe_tokenizer(chat_texts(chats), cfg.tokenizer_vocab)
        spec = msgspec.structs.replace(spec, vocab_size=max(spec.vocab_size, -(-len(tok) // 64) * 64))
        model = build_tiny_model(spec, tok)
    elif cfg.base == "tiny" and cfg.init:
        tok = build_tiny_tokenizer()
        model = build_tiny_model(msgspec.convert(cfg.init, TinyModelSpec), tok)
    else:
        tok = load_tokenizer(cfg.base, chat_template)
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.base), dtype=torch.float32)
    renderer = ChatRenderer(tok)
    data = [encode_chat(renderer, c) for c in chats]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    pad = tok.pad_token_id or 0
    t0 = time.monotonic()
    loss_v = float("nan")
    for step in range(cfg.steps):
        batch = [data[rng.randrange(len(data))] for _ in range(cfg.batch_size)]
        opt.zero_grad()
        loss_v = backward_nll(model, batch, pad)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % max(1, cfg.steps // 10) == 0 or step == cfg.steps - 1:
            log.info("sft step %d/%d loss %.4f", step + 1, cfg.steps, loss_v)
            print(f"sft step {step + 1}/{cfg.steps}  loss {loss_v:.4f}", flush=True)
    model.eval()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / FINGERPRINT_FILE).write_text(sft_fingerprint(cfg, seed, chats))
    return {"loss": loss_v, "seconds": time.monotonic() - t0, "samples": len(data)}
