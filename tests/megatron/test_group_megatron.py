"""Two megatron ranks in the Ray trainer group (gloo) step like one MegatronTrainer, as data
parallel 2 and as tensor parallel 2 (weights sliced, vocab-parallel logits, grad norm over
the slices), and save/load restores every rank."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from rl360.actors.trainer_group import TrainerGroup
from rl360.recipe import LossSection, MegatronSection, TrainerSection
from rl360.types import Batch
from tests.megatron.conftest import MEGATRON_MISSING, samples

pytest.importorskip("megatron.core", reason=MEGATRON_MISSING)
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

from rl360.policies.megatron.trainer import MegatronTrainer  # noqa: E402


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("tensor_parallel", [1, 2], ids=["dp2", "tp2"])
def test_two_megatron_workers_step_like_one(ray_cluster, tiny_dir: Path,  # type: ignore[no-untyped-def]
                                            tmp_path: Path, tensor_parallel: int) -> None:
    # grad_clip 0.5 < the grad norm: clipping must use the norm over all TP slices
    cfg = TrainerSection(lr=1e-3, micro_batch_size=3, grad_clip=0.5, loss=LossSection(name="ppo"))
    one = MegatronTrainer(cfg, tiny_dir)
    group = TrainerGroup(msgspec.structs.replace(cfg, workers=2, num_cpus=0, backend="megatron",
                                                 megatron=MegatronSection(tensor_parallel=tensor_parallel)),
                         tiny_dir)
    try:
        b0, b1 = (Batch(samples=samples(9, seed=s, max_len=40), step=s) for s in (11, 12))
        m1, m2 = one.train_step(b0), group.train_step(b0)
        assert [i["tp_rank"] for i in group.info] == ([0, 0] if tensor_parallel == 1 else [0, 1])
        assert m2["workers"] == 2.0 and m2["local_tokens"] == m1["tokens"]
        assert m1["grad_norm"] > 0.5
        for key in ("loss", "grad_norm", "entropy"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        assert max_diff(one.state_dict_for_sync(), group.state_dict_for_sync()) < 1e-5
        group.save(tmp_path / "ckpt")
        group.train_step(b1)
        assert group.load(tmp_path / "ckpt") == 1
        group.train_step(b1)
        one.train_step(b1)
        assert max_diff(one.state_dict_for_sync(), group.state_dict_for_sync()) < 1e-5
    finally:
        group.shutdown()
