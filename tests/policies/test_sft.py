"""`rl360 sft`: the BPE tokenizer it can train for a tiny policy, chats with tools, and the
length-chunked loss (the same token-mean as one padded batch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rl360.policies.chat import ChatRenderer
from rl360.policies.sft import backward_nll, chat_texts, encode_chat, length_chunks, tiny_spec
from rl360.policies.tiny import TINY_PRESETS, build_bpe_tokenizer, build_tiny_model
from rl360.types import Message, ToolSpec

CALL = {"id": "c0", "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"command": "python3 /app/x.py"})}}
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]


def _chats(n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        k = i % 17 + 2
        out.append({"messages": [
            {"role": "user", "content": f"Write a Python function add_{k}(x) that returns x plus {k}."},
            {"role": "assistant", "content": f"def add_{k}(x):\n    return x + {k}"}]})
    return out


def test_bpe_tokenizer_is_deterministic_compact_and_lossless() -> None:
    texts = list(chat_texts(_chats(200)))
    a, b = build_bpe_tokenizer(texts, 400), build_bpe_tokenizer(texts, 400)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    line = "def add_7(x):\n    return x + 7"
    assert len(a.encode(line)) < len(line.encode()) / 2  # merges learned from the data
    odd = "naïve 🙂 <tool_call>{\"k\": [1, 2]}</tool_call>\t\x00"
    assert a.decode(a.encode(odd)) == odd  # any text still round-trips (every byte is a token)
    for t in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert len(a.encode(t, add_special_tokens=False)) == 1
    with pytest.raises(ValueError, match="256"):
        build_bpe_tokenizer(texts, 100)


def test_encode_chat_trains_on_the_tool_call_as_the_template_writes_it() -> None:
    tok = build_bpe_tokenizer(chat_texts(_chats(50)), 300)
    r = ChatRenderer(tok)
    chat = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Run /app/x.py"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]}]}
    ids, mask = encode_chat(r, chat)
    prompt = tok.decode(ids[: mask.index(1)])
    assert '"name": "bash"' in prompt and "Run a command." in prompt  # tools in the system block
    target = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert target == ('<tool_call>\n{"name": "bash", "arguments": {"command": "python3 /app/x.py"}}'
                      "\n</tool_call><|im_end|>")
    # a plain answer is exactly its text and the end-of-turn token, as before
    ids, mask = encode_chat(r, _chats(1)[0])
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == (
        "def add_2(x):\n    return x + 2<|im_end|>")


def test_encode_chat_trains_on_every_assistant_turn_and_masks_tool_results() -> None:
    """A multi-turn tool chat: the loss covers each assistant turn (tool call or answer) and its
    end-of-turn token, never the system prompt, tools, user turn or tool results; and the ids
    are what the session ledger holds: each turn's prompt is the template's render of the
    conversation so far."""
    tok = build_bpe_tokenizer(chat_texts(_chats(50)), 300)
    r = ChatRenderer(tok)
    chat = {"tools": TOOLS, "messages": [
        {"role": "system", "content": "You are in a sandbox."},
        {"role": "user", "content": "Run /app/x.py"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "SECRET-OUTPUT 42\n[exit code 0]", "tool_call_id": "c0",
         "name": "bash"},
        {"role": "assistant", "content": "Done."}]}
    ids, mask = encode_chat(r, chat)
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(trained) == (
        '<tool_call>\n{"name": "bash", "arguments": {"command": "python3 /app/x.py"}}'
        "\n</tool_call><|im_end|>Done.<|im_end|>")
    context = tok.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert "SECRET-OUTPUT 42" in context and "You are in a sandbox." in context
    msgs = [msgspec.convert(m, Message) for m in chat["messages"]]
    tools = [msgspec.convert(t, ToolSpec) for t in TOOLS]
    second = len(ids) - len(tok.encode("Done.", add_special_tokens=False)) - 1
    assert ids[:second] == r.render(msgs[:4], tools, add_generation_prompt=True)
    assert ids == [*r.render(msgs, tools, add_generation_prompt=False)[:len(ids)]]


def test_chunked_loss_and_gradients_equal_one_padded_batch() -> None:
    import torch

    torch.manual_seed(0)
    tok = build_bpe_tokenizer(chat_texts(_chats(50)), 300)
    model = build_tiny_model(msgspec.structs.replace(TINY_PRESETS["default"], vocab_size=320), tok)
    model = model.double()
    r = ChatRenderer(tok)
    batch = [encode_chat(r, c) for c in _chats(7)]
    long_one = encode_chat(r, {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Run /app/x.py"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]}]})
    batch.append(long_one)
    assert len(length_chunks(batch, max_tokens=4 * len(long_one[0]))) > 1

    def grads(fn: Any) -> tuple[float, list[Any]]:
        model.zero_grad()
        loss = fn()
        return loss, [p.grad.clone() for p in model.parameters()]

    def one_batch() -> float:
        width = max(len(x) for x, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.double)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (x, m) in enumerate(batch):
            ids[i, : len(x)], mask[i, : len(m)], attn[i, : len(x)] = (
                torch.tensor(x), torch.tensor(m, dtype=torch.double), 1)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1], -1)
        nll = -(logp.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]).sum() / mask[:, 1:].sum()
        nll.backward()
        return float(nll.detach())

    ref_loss, ref = grads(one_batch)
    loss, got = grads(lambda: backward_nll(model, batch, pad=0))
    assert loss == pytest.approx(ref_loss, rel=1e-6)  # the loss runs in fp32 (.float())
    for g, h in zip(got, ref, strict=True):
        assert torch.allclose(g, h, rtol=1e-5, atol=1e-8)


def test_tiny_spec_takes_the_preset_and_refuses_other_bases() -> None:
    spec = tiny_spec("tiny:demo", {"num_hidden_layers": 4})
    assert spec.hidden_size == TINY_PRESETS["demo"].hidden_size and spec.num_hidden_layers == 4
    with pytest.raises(ValueError, match="tiny"):
        tiny_spec("smollm2", {})
    with pytest.raises(ValueError, match="tiny"):
        tiny_spec("tiny:nope", {})


def test_run_sft_with_a_bpe_writes_a_loadable_policy(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl360.policies.sft import run_sft, warm_start_is_current
    from rl360.recipe import SftSection

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in _chats(40)))
    cfg = SftSection(data=str(data), base="tiny", steps=3, batch_size=8, tokenizer_vocab=300,
                     out=str(tmp_path / "out"))
    assert not warm_start_is_current(cfg, 0)
    stats = run_sft(cfg)
    # `rl360 train` reuses the warm start only while its [sft] settings and data are the same
    assert warm_start_is_current(cfg, 0)
    assert not warm_start_is_current(msgspec.structs.replace(cfg, lr=cfg.lr / 2), 0)
    assert not warm_start_is_current(cfg, 1)
    data.write_text("".join(json.dumps(c) + "\n" for c in _chats(41)))
    assert not warm_start_is_current(cfg, 0)
    assert stats["samples"] == 40
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert 256 < len(tok) <= model.config.vocab_size
    assert len(tok.encode("def add_7(x):")) < len("def add_7(x):")
