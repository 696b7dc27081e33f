"""The bucketed broadcast of rl360.weights.nccl run over gloo on CPU: a sender and a receiver
process in a standalone group (the group code and bucket loop are the ones NCCL runs on GPUs;
tests/gpu/test_nccl_sync.py runs them with NCCL)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from rl360.ray_session import free_port
from rl360.weights.nccl import GroupReceiver, GroupSender
from rl360.weights.plan import NameMap, checksum_state, plan_buckets


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "module.model.embed.weight": torch.randn(64, 16, generator=g),
        "module.model.norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "module.model.layers.0.w": torch.randn(32, 16, generator=g),
        "module.model.step": torch.arange(5, dtype=torch.int64),
        "module.lm_head.weight": torch.randn(64, 16, generator=g),
    }


def _receiver(port: int, group: str, buckets, layout: str, q) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    rx = GroupReceiver("127.0.0.1", port, 2, 1, "gloo", group)
    got = rx.receive(buckets, layout)
    q.put(checksum_state(got))
    rx.close()


@pytest.mark.parametrize("layout", ["flat", "per_tensor"])
def test_bucketed_broadcast_arrives_intact(layout: str) -> None:
    names = NameMap(drop=[r"^lm_head\."])
    sender = GroupSender(_state, names)
    spec = sender.spec()
    assert [n for n, _, _ in spec] == ["model.embed.weight", "model.norm.weight",
                                       "model.layers.0.w", "model.step"]
    buckets = plan_buckets(spec, bucket_mb=0.002)  # ~2 KB: several buckets, one oversized
    assert len(buckets) >= 3
    port = free_port()
    group = f"rl360-test-weights-{layout}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, group, buckets, layout, q), daemon=True)
    proc.start()
    try:
        sender.open("127.0.0.1", port, 2, "gloo", group)
        sent = sender.send(buckets, layout)
        got = q.get(timeout=120)
        sender.close()
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()  # our own child
    assert sent == sum(v.numel() * v.element_size() for v in sender.state().values())
    assert got == sender.checksums(dict.fromkeys(got), None)
    assert set(got) == {n for n, _, _ in spec}


def test_send_before_open_is_refused() -> None:
    with pytest.raises(RuntimeError, match="before open"):
        GroupSender(_state).send()


def _gloo_receiver(port: int, spec, q) -> None:  # type: ignore[no-untyped-def]
    from rl360.weights.gloo import GlooGroup

    torch.set_num_threads(1)
    group = GlooGroup("127.0.0.1", port, 1, 2, chunk_mb=0.001)
    for _ in range(2):  # two versions through the same (reused) buffers
        q.put(checksum_state(group.receive(spec)))


def test_gloo_group_sends_versions_in_chunks() -> None:
    """The CPU collective path: flat per-dtype buffers kept between versions, each broadcast
    as many ~1 KB chunks in flight at once; both versions arrive intact."""
    from rl360.weights.gloo import GlooGroup, tensor_spec

    state = _state()
    spec = tensor_spec(state)
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_gloo_receiver, args=(port, spec, q), daemon=True)
    proc.start()
    try:
        group = GlooGroup("127.0.0.1", port, 0, 2, chunk_mb=0.001)
        got = []
        for _ in range(2):
            group.send(state)
            got.append(q.get(timeout=120))
            want = checksum_state(state)
            assert got[-1] == want
            for v in state.values():
                v.add_(1)
        assert got[0] != got[1]
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()  # our own child
