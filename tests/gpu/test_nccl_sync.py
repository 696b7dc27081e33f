"""The GPU weight transports: bucketed NCCL broadcast between two processes (needs two GPUs:
NCCL refuses two ranks on one device), sharded senders over NCCL (trainer ranks each sending
the tensors they hold to a replica on another GPU), and the CUDA IPC path for a colocated
engine, each verified tensor by tensor with checksums."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.common import HAS_CUDA, needs_cuda, run_json

pytestmark = [needs_cuda, pytest.mark.gpu, pytest.mark.timeout(600)]


def _gpus() -> int:
    if not HAS_CUDA:
        return 0
    import torch

    return torch.cuda.device_count()


def test_cuda_ipc_sync_arrives_intact(tmp_path: Path) -> None:
    res = run_json(tmp_path / "nccl.json", "nccl")
    assert res["ipc"]["ok"], res["ipc"]


@pytest.mark.skipif(_gpus() < 2, reason=f"no GPU: NCCL needs two GPUs for two ranks ({_gpus()} here)")
def test_nccl_bucketed_broadcast_arrives_intact(tmp_path: Path) -> None:
    res = run_json(tmp_path / "nccl.json", "nccl")
    assert res["nccl"]["ok"], res["nccl"]
    assert res["buckets"] > 1


@pytest.mark.skipif(_gpus() < 2, reason=f"no GPU: sharded NCCL senders need a GPU per rank, a sender "
                    f"and a replica ({_gpus()} here)")
def test_nccl_sharded_senders_arrive_intact(tmp_path: Path) -> None:
    res = run_json(tmp_path / "nccl.json", "nccl")
    assert res["shards"]["ok"], res["shards"]
    assert res["shards"]["buckets"] > 1
