"""Fixtures for the megatron-core trainer tier (`make test-megatron`): tiny Llama, Qwen2 and Qwen3
HF directories built from configs, and random training samples. Tests that need megatron-core
skip with a reason when it is not importable (the default venv)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rl360.types import TrainSample

MEGATRON_MISSING = ("megatron-core is not importable in this venv: `make test-megatron` "
                    "installs megatron-core 0.16 (--no-deps, CPU torch) and runs this tier")


def hf_config(family: str, *, tied: bool, vocab: int = 320) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tied, rms_norm_eps=1e-6, pad_token_id=0)
    if family == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    if family == "qwen3":  # QK-norm, no qkv bias, a head_dim of its own (not 64 / 4)
        return Qwen3Config(**common, head_dim=24,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def hf_model(family: str, *, tied: bool, seed: int = 0) -> Any:
    """A tiny random HF model; biases and norm weights are randomized too, so a wrong
    mapping of any tensor shows."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, tied=tied), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model.eval()


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (qkv bias, untied head) policy as an HF directory, with the tiny tokenizer."""
    from rl360.policies.tiny import build_tiny_tokenizer

    out = tmp_path_factory.mktemp("qwen2-tiny")
    hf_model("qwen2", tied=False, seed=1).save_pretrained(out, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(autouse=True)
def _two_torch_threads() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def samples(n: int, *, seed: int = 0, vocab: int = 256, max_len: int = 24) -> list[TrainSample]:
    """n random sequences: a 3-token prompt, loss tokens with one masked (tool output) hole,
    sampling logprobs near -log(vocab), advantages around 0."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(6, max_len)
        mask = [0] * 3 + [1] * (length - 3)
        mask[5] = 0
        out.append(TrainSample(
            tokens=[rng.randrange(vocab) for _ in range(length)], mask=mask,
            sampling_logprobs=[-5.55 + rng.gauss(0.0, 0.3) if m else 0.0 for m in mask],
            advantage=rng.gauss(0.0, 1.0), reward=float(rng.random() < 0.5),
        ))
    return out


def pytest_configure(config: pytest.Config) -> None:
    # megatron-core 0.16 warns at every layer about apex / TE / tp_group on this CPU-only setup
    for category in ("DeprecationWarning", "UserWarning"):
        config.addinivalue_line("filterwarnings", f"ignore::{category}:megatron")
