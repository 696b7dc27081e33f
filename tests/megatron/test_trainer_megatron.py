"""MegatronTrainer against TorchTrainer on the same tiny model and batch (fp32): same loss,
same gradients (cosine >= 0.9999, compared under HF names), HF-named sync weights, and an HF
checkpoint that transformers loads and `load` resumes from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from rl360.policies.megatron.convert import mcore_to_hf
from rl360.policies.trainer_torch import TorchTrainer
from rl360.recipe import LossSection, MegatronSection, TrainerSection
from rl360.types import Batch
from tests.megatron.conftest import MEGATRON_MISSING, samples

pytest.importorskip("megatron.core", reason=MEGATRON_MISSING)

from rl360.policies.megatron.trainer import MegatronTrainer
from rl360.policies.trainer_backends import build_trainer


def capture_grads(trainer: Any, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """Record each parameter's gradient when train_step calls optimizer.step()."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        grads.update({names[id(p)]: p.grad.detach().clone() for p in trainer.params
                      if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    return grads


def hf_grads(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return capture_grads(t, {id(p): n for n, p in t.model.named_parameters()})


def megatron_grads(t: MegatronTrainer) -> dict[str, torch.Tensor]:
    return capture_grads(t, {id(p): n for n, p in t.model.named_parameters()})


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(),
                                                       b.flatten().double(), dim=0))


LOSSES = [
    LossSection(name="ppo", reducer="token-mean"),
    LossSection(name="gspo", reducer="seq-mean-token-mean"),
    LossSection(name="reinforce", reducer="seq-mean-token-sum-norm", norm_length=32, kl_coef=0.1),
]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("loss", LOSSES, ids=lambda c: f"{c.name}-{c.reducer}")
def test_loss_and_gradients_match_the_torch_backend(
    family: str, loss: LossSection, tiny_dir: Path, qwen2_dir: Path
) -> None:
    path = tiny_dir if family == "llama" else qwen2_dir
    cfg = TrainerSection(lr=1e-3, micro_batch_size=3, grad_clip=0.0, loss=loss)
    batch = Batch(samples=samples(8, seed=5, max_len=30))
    ref = TorchTrainer(cfg, path)
    meg = MegatronTrainer(cfg, path)
    g_ref, g_meg = hf_grads(ref), megatron_grads(meg)
    m_ref, m_meg = ref.train_step(batch), meg.train_step(batch)
    assert m_meg["skipped"] == 0.0 and m_meg["step"] == 1.0
    assert abs(m_meg["loss"] - m_ref["loss"]) < 1e-5
    assert m_meg["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-4)
    for k in ("entropy", "logprob_mean"):
        assert m_meg[k] == pytest.approx(m_ref[k], abs=1e-4), k
    as_hf = mcore_to_hf(g_meg, meg.shape)
    assert set(g_ref) <= set(as_hf)
    for name, g in g_ref.items():
        assert cosine(as_hf[name], g) >= 0.9999, name
    flat_ref = torch.cat([g.flatten() for g in g_ref.values()])
    flat_meg = torch.cat([as_hf[n].flatten() for n in g_ref])
    assert cosine(flat_meg, flat_ref) >= 0.9999


def test_micro_batch_size_does_not_change_the_loss(tiny_dir: Path) -> None:
    batch = Batch(samples=samples(7, seed=2, max_len=40))
    losses = []
    for micro in (16, 2):
        cfg = TrainerSection(lr=1e-3, micro_batch_size=micro,
                            loss=LossSection(name="ppo", reducer="token-mean"))
        losses.append(MegatronTrainer(cfg, tiny_dir).train_step(batch)["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_sync_weights_checkpoint_and_resume(tiny_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    cfg = TrainerSection(lr=1e-3, micro_batch_size=4)
    t = build_trainer(msgspec.structs.replace(cfg, backend="megatron"), tiny_dir)
    assert isinstance(t, MegatronTrainer)
    before = t.state_dict_for_sync()
    torch_keys = set(TorchTrainer(cfg, tiny_dir).state_dict_for_sync())
    assert set(before) == torch_keys
    assert before["lm_head.weight"] is before["model.embed_tokens.weight"]  # tied: one copy
    t.train_step(Batch(samples=samples(6, seed=1)))
    after = t.state_dict_for_sync()
    moved = max(float((after[k] - before[k]).abs().max()) for k in after)
    assert moved > 0.0
    out = t.save(tmp_path / "ckpt")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, after[k]), k
    assert (out / "tokenizer.json").is_file()

    resumed = MegatronTrainer(cfg, tiny_dir)
    resumed.load(out)
    assert resumed.step == 1
    nxt = Batch(samples=samples(6, seed=9))
    m1, m2 = t.train_step(nxt), resumed.train_step(nxt)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6)
    a, b = t.state_dict_for_sync(), resumed.state_dict_for_sync()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_model_parallel_and_bad_backend_are_refused_by_name(tiny_dir: Path) -> None:
    cfg = TrainerSection(backend="megatron")
    with pytest.raises(NotImplementedError,
                       match=r"trainer.megatron.pipeline_parallel=2: the megatron backend supports at most 1"):
        build_trainer(msgspec.structs.replace(cfg, megatron=MegatronSection(pipeline_parallel=2)), tiny_dir)
    with pytest.raises(ValueError, match="not a multiple of the model-parallel size 2"):
        build_trainer(msgspec.structs.replace(cfg, megatron=MegatronSection(tensor_parallel=2)), tiny_dir)  # one process
    with pytest.raises(ValueError, match="trainer backend 'jax'"):
        build_trainer(msgspec.structs.replace(cfg, backend="jax"), tiny_dir)
