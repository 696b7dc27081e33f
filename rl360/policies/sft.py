"""Supervised fine-tuning on chats (`rl360 sft`): warm-starts small policies before RL.

Data is a JSONL file of {"messages": [...]} chats or a "module:function" generator returning
such chats. Each chat is tokenized with the chat template exactly as the session server will
render it (prompt = all but the last message, with the generation prompt); the loss is the
token-mean NLL of the last (assistant) message and its end-of-turn token."""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger("rl360.sft")


def load_chats(spec: str, n: int, seed: int) -> list[dict[str, Any]]:
    if spec.endswith(".jsonl"):
        with open(spec) as f:
            return [json.loads(line) for line in f if line.strip()]
    if ":" in spec:
        import importlib.util
        import sys

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


def encode_chat(renderer: Any, chat: dict[str, Any]) -> tuple[list[int], list[int]]:
    from rl360.types import Message

    msgs = [msgspec.convert(m, Message) for m in chat["messages"]]
    if not msgs or msgs[-1].role != "assistant":
        raise ValueError("each SFT chat must end with an assistant message")
    prompt = renderer.render(msgs[:-1], None, add_generation_prompt=True)
    answer = [*renderer.encode(msgs[-1].content or ""), renderer.end_of_turn_id]
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def run_sft(cfg: Any, seed: int = 0) -> dict[str, float]:
    """cfg: the recipe's SftSection. Writes an HF model directory to cfg.out."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl360.policies.chat import ChatRenderer
    from rl360.policies.loading import load_tokenizer, resolve_model_path
    from rl360.policies.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    if cfg.base == "tiny" and cfg.init:
        tok = build_tiny_tokenizer()
        model = build_tiny_model(msgspec.convert(cfg.init, TinyModelSpec), tok)
    else:
        tok = load_tokenizer(cfg.base)
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.base), dtype=torch.float32)
    renderer = ChatRenderer(tok)
    data = [encode_chat(renderer, c) for c in load_chats(cfg.data, cfg.samples, seed)]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    pad = tok.pad_token_id or 0
    t0 = time.monotonic()
    loss_v = float("nan")
    for step in range(cfg.steps):
        batch = [data[rng.randrange(len(data))] for _ in range(cfg.batch_size)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width))
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (x, m) in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
            attn[i, : len(x)] = 1
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        m = mask[:, 1:]
        loss = -(logp * m).sum() / m.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_v = float(loss)
        if step % max(1, cfg.steps // 10) == 0 or step == cfg.steps - 1:
            log.info("sft step %d/%d loss %.4f", step + 1, cfg.steps, loss_v)
            print(f"sft step {step + 1}/{cfg.steps}  loss {loss_v:.4f}", flush=True)
    model.eval()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return {"loss": loss_v, "seconds": time.monotonic() - t0, "samples": len(data)}
