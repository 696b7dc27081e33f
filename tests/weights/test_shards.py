"""Sharded, bucketed weight sync (rl360.weights.shards) in one process: trainer ranks and
replicas as threads over gloo. The plan covers every element once with buckets no larger than
the limit; replicas assemble bit-exact full tensors in the engines' dtype from every rank at
once; a corrupt bucket, a group that never forms and a sender that never sends each fail
within their timeout instead of hanging."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from rl360.weights.shard_groups import ShardBroken, ShardReceiver, ShardSender
from rl360.weights.shards import (
    Bucket,
    Held,
    Piece,
    RankPart,
    bucket_limit,
    combine,
    cut_buckets,
    held_parts,
    rank_part,
)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(40, 24, generator=g)
    return {"embed.weight": emb, "layers.0.w": torch.randn(64, 24, generator=g),
            "norm.weight": torch.randn(24, generator=g),
            "step": torch.arange(7, dtype=torch.int64), "lm_head.weight": emb}


def test_buckets_hold_the_limit_and_split_big_tensors() -> None:
    held = [Held("a", [100], "torch.bfloat16", 0, torch.zeros(100)),
            Held("b", [3], "torch.float32", 0, torch.zeros(3)),
            Held("c", [50], "torch.bfloat16", 50, torch.zeros(25))]
    buckets = cut_buckets(held, 64)
    assert all(b.nbytes <= 64 and b.nbytes % 8 == 0 for b in buckets)
    got = {}
    for b in buckets:
        for p in b.pieces:
            assert p.offset % 8 == 0
            got.setdefault(p.name, []).append((p.start, p.numel))
    assert sum(n for _, n in got["a"]) == 100 and len(got["a"]) > 1  # split
    assert got["c"][0][0] == 50  # a shard starting mid-tensor keeps its offset
    with pytest.raises(ValueError, match="cannot hold one element"):
        cut_buckets([Held("x", [1], "torch.float64", 0, torch.zeros(1))], 4)


def test_the_plan_covers_every_element_exactly_once() -> None:
    state = _state()
    limit = bucket_limit(0.001)
    parts = [rank_part(state, r, 2, "bfloat16", limit)[0] for r in range(2)]
    plan = combine(parts, limit)
    assert plan.aliases == {"lm_head.weight": "embed.weight"}
    assert {n for n, _, _ in plan.spec} == {"embed.weight", "layers.0.w", "norm.weight", "step"}
    assert dict((n, d) for n, _, d in plan.spec)["step"] == "torch.int64"  # not cast
    assert dict((n, d) for n, _, d in plan.spec)["norm.weight"] == "torch.bfloat16"
    assert all(plan.ranks[r] for r in range(2))  # the tensors are split between the ranks
    spec, _ = parts[0].spec, parts[0].aliases
    gap = RankPart(1, spec, parts[1].aliases, parts[1].buckets[1:])
    with pytest.raises(ValueError, match="sent by no rank"):
        combine([parts[0], gap], limit)
    twice = RankPart(1, spec, parts[1].aliases, parts[1].buckets + parts[0].buckets[:1])
    with pytest.raises(ValueError, match="twice"):
        combine([parts[0], twice], limit)
    other = RankPart(1, spec[1:], {}, [Bucket([Piece("norm.weight", 0, 24, 0)], 48)])
    with pytest.raises(ValueError, match="other tensors"):
        combine([parts[0], other], limit)


def _run(senders: list[ShardSender], plan: Any, replicas: int, version: int = 1,
         checksum_sent: bool = True, timeout_s: float = 30.0,
         skip_send: bool = False) -> tuple[list[Any], list[Any]]:
    """One epoch: every sender listens, every replica joins and receives, all as threads."""
    world = replicas + 1
    addrs = {r: s.listen(1, "127.0.0.1", world, timeout_s) for r, s in enumerate(senders)}
    recvs = [ShardReceiver() for _ in range(replicas)]
    out: list[Any] = [None] * replicas
    sent: list[Any] = [None] * len(senders)

    def replica(i: int) -> None:
        try:
            recvs[i].join(1, addrs, i + 1, world, "gloo", timeout_s)
            out[i] = {k: v.clone() for k, v in recvs[i].receive(plan, timeout_s).items()}
        except Exception as exc:
            out[i] = exc

    def sender(r: int) -> None:
        try:
            if skip_send:  # form the group, then never send
                from rl360.weights.shard_groups import ShardGroup, group_name

                store, w = senders[r]._stores[1]
                g = ShardGroup(store, 0, w, "gloo", group_name(1, r), timeout_s)
                time.sleep(timeout_s * 3)
                g.close()
                return
            sent[r] = senders[r].send(1, version, "gloo", timeout_s, timeout_s, checksum_sent)
        except Exception as exc:
            sent[r] = exc

    threads = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(replicas)]
    threads += [threading.Thread(target=sender, args=(r,), daemon=True)
                for r in range(len(senders))]
    for t in threads:
        t.start()
    for t in threads[:replicas]:
        t.join(timeout=120)
    return out, sent


@pytest.mark.parametrize("ranks", [1, 3])
def test_replicas_assemble_the_exact_engine_weights(ranks: int) -> None:
    state = _state()
    senders = [ShardSender(lambda: state, r, ranks) for r in range(ranks)]
    limit_mb = 0.002
    plan = combine([s.layout("bfloat16", limit_mb) for s in senders], bucket_limit(limit_mb))
    out, sent = _run(senders, plan, replicas=2)
    want = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in state.items()}
    for got in out:
        assert not isinstance(got, Exception), got
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8)
                                                                 if got[k].dtype.is_floating_point
                                                                 else got[k],
                                                                 want[k].view(torch.uint8)
                                                                 if want[k].dtype.is_floating_point
                                                                 else want[k]), k
    assert sum(s["bytes"] for s in sent) == plan.nbytes
    assert all(s["buckets"] >= 1 for s in sent if s["bytes"])


def test_a_corrupt_bucket_is_refused() -> None:
    state = _state()
    sender = ShardSender(lambda: state, 0, 1)
    plan = combine([sender.layout(None, 1.0)], bucket_limit(1.0))
    out, _ = _run([sender], plan, replicas=1, checksum_sent=False)  # trailer 0: not its sum
    assert isinstance(out[0], ShardBroken) and "checksum" in str(out[0])


def test_a_replica_that_never_joins_fails_the_send_in_time() -> None:
    state = _state()
    sender = ShardSender(lambda: state, 0, 1)
    sender.layout(None, 1.0)
    sender.listen(1, "127.0.0.1", 2, 2.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not form within 2s"):
        sender.send(1, 1, "gloo", 2.0, 2.0)
    assert time.monotonic() - t0 < 20


def test_a_sender_that_never_sends_fails_the_receive_in_time() -> None:
    state = _state()
    sender = ShardSender(lambda: state, 0, 1)
    plan = combine([sender.layout(None, 1.0)], bucket_limit(1.0))
    t0 = time.monotonic()
    out, _ = _run([sender], plan, replicas=1, timeout_s=2.0, skip_send=True)
    assert isinstance(out[0], ShardBroken), out[0]
    assert time.monotonic() - t0 < 20


def test_held_parts_split_replicated_tensors_by_size() -> None:
    state = _state()
    mine = [held_parts(state, r, 2, None)[2] for r in range(2)]
    names = [{h.name for h in m} for m in mine]
    assert names[0].isdisjoint(names[1]) and names[0] | names[1] == {
        "embed.weight", "layers.0.w", "norm.weight", "step"}
