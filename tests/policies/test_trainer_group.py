"""The Ray trainer group: W=2 (gloo, summed gradients, global denominators) steps exactly
like W=1; named actors; sync state dict; save/load across ranks."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from rl360.actors.trainer_group import TrainerGroup, split_by_tokens
from rl360.policies.trainer_torch import TorchTrainer
from rl360.recipe import LossSection, TrainerSection
from rl360.types import Batch, TrainSample


def test_split_balances_tokens() -> None:
    lens = [50, 10, 40, 30, 20, 20, 5]
    samples = [TrainSample(tokens=[0] * n, mask=[0] * n, sampling_logprobs=[0.0] * n,
                           advantage=0.0) for n in lens]
    shards = split_by_tokens([len(s.tokens) for s in samples], 2)
    assert sorted(i for s in shards for i in s) == list(range(len(lens)))
    loads = [sum(lens[i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 5
    assert split_by_tokens([len(samples[0].tokens)], 3)[1:] == [[], []]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.ray
@pytest.mark.parametrize("backend", ["torch", "fsdp"])
async def test_two_workers_step_like_one(ray_cluster, tiny_dir: Path, make_samples,  # type: ignore[no-untyped-def]
                                         tmp_path: Path, backend: str) -> None:
    import ray

    cfg = TrainerSection(lr=1e-3, micro_batch_size=3, loss=LossSection(name="ppo", tis_cap=2.0))
    one = TorchTrainer(cfg, tiny_dir)  # W=1: exactly what a lone worker runs
    group = TrainerGroup(msgspec.structs.replace(cfg, workers=2, num_cpus=0, backend=backend),
                         tiny_dir)
    try:
        assert ray.get_actor("rl360-trainer-1") is not None
        b0, b1 = (Batch(samples=make_samples(9, seed=s, max_len=40, noise=0.3), step=s)
                  for s in (11, 12))
        m1 = one.train_step(b0)
        m2 = group.train_step(b0)
        tokens = sum(sum(s.mask) for s in b0.samples)
        assert m1["tokens"] == m2["tokens"] == m2["local_tokens"] == tokens
        assert m2["workers"] == 2.0 and m2["rank_token_imbalance"] < 1.2
        for key in ("loss", "grad_norm", "entropy", "mismatch_abs_max", "tis_capped_frac"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        assert _max_diff(one.state_dict_for_sync(), group.state_dict_for_sync()) < 1e-5
        # a checkpoint restores every rank (a rank left behind would change the summed grads)
        group.save(tmp_path / "ckpt")
        group.train_step(b1)
        assert group.load(tmp_path / "ckpt") == 1
        group.train_step(b1)
        one.train_step(b1)
        after = ray.get(group.state_dict_ref())
        assert _max_diff(one.state_dict_for_sync(), after) < 1e-5
        if backend == "fsdp":  # its optimizer state is sharded: it resumes only as fsdp
            return
        # ... and it is an HF directory a plain trainer resumes from
        plain = TorchTrainer(cfg, tiny_dir)
        plain.load(tmp_path / "ckpt")
        plain.train_step(b1)
        assert plain.step == 2 and _max_diff(plain.state_dict_for_sync(), after) < 1e-5
    finally:
        group.shutdown()
