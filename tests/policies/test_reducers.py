"""Loss reducers use global denominators: the loss and its gradient do not change when a
batch runs as one micro-batch, as four, or split over two data-parallel ranks (simulated by
summing, and for real with two torch.distributed gloo processes)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from rl360.policies.losses import LossSection, build_policy_loss
from rl360.policies.reducers import REDUCERS, build_reducer, global_denominators
from rl360.types import TrainSample

V = 256  # bigram "model": logits of the next token = P[current token]
CASES = [
    LossSection(name="ppo", reducer="token-mean"),
    LossSection(name="ppo", reducer="seq-mean-token-mean", kl_coef=0.05),
    LossSection(name="gspo", reducer="seq-mean-token-mean", eps_low=0.05, eps_high=0.06),
    LossSection(name="reinforce", reducer="seq-mean-token-sum-norm", norm_length=32),
    LossSection(name="ppo", reducer="seq-mean-token-sum-norm", kl_coef=0.1, kl_estimator="k1"),
]


def _params(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(V, V, generator=g, dtype=torch.float64)
    old = p + 0.2 * torch.randn(V, V, generator=g, dtype=torch.float64)  # ratios != 1: clips
    ref = p + 0.1 * torch.randn(V, V, generator=g, dtype=torch.float64)
    return p, old, ref


def _logprobs(p: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logits = p[ids[:, :-1]]
    return logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def shard_loss_and_grad(
    cfg: LossSection, samples: list[TrainSample], micro: int, gt: int, gs: int, seed: int = 0
) -> tuple[float, torch.Tensor]:
    """Sum of the reduced loss over micro-batches of `micro` sequences, and dLoss/dP."""
    p0, old_p, ref_p = _params(seed)
    p = p0.clone().requires_grad_(True)
    loss_fn = build_policy_loss(cfg)
    reduce = build_reducer(cfg.reducer, cfg.norm_length)
    total = 0.0
    for start in range(0, len(samples), micro):
        chunk = samples[start : start + micro]
        width = max(len(s.tokens) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.float64)
        samp = torch.zeros(len(chunk), width, dtype=torch.float64)
        for r, s in enumerate(chunk):
            ids[r, : len(s.tokens)] = torch.tensor(s.tokens)
            mask[r, : len(s.mask)] = torch.tensor(s.mask, dtype=torch.float64)
            samp[r, : len(s.tokens)] = torch.tensor(s.sampling_logprobs, dtype=torch.float64)
        adv = torch.tensor([s.advantage for s in chunk], dtype=torch.float64)
        logp = _logprobs(p, ids)
        with torch.no_grad():
            old, ref = _logprobs(old_p, ids), _logprobs(ref_p, ids)
        per_tok, _ = loss_fn(logp, old, samp[:, 1:], adv, mask[:, 1:], ref)
        loss = reduce(per_tok, mask[:, 1:], global_tokens=gt, global_seqs=gs)
        loss.backward()
        total += float(loss)
    assert p.grad is not None
    return total, p.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.name}-{c.reducer}-kl{c.kl_coef}")
def test_loss_and_grad_do_not_depend_on_the_split(cfg: LossSection, make_samples) -> None:  # type: ignore[no-untyped-def]
    samples = make_samples(8, seed=1, min_len=4, max_len=30, noise=0.3)
    gt, gs = global_denominators(s.mask for s in samples)
    loss1, grad1 = shard_loss_and_grad(cfg, samples, 8, gt, gs)
    loss4, grad4 = shard_loss_and_grad(cfg, samples[::-1], 2, gt, gs)  # other order, padding
    la, ga = shard_loss_and_grad(cfg, samples[:3], 2, gt, gs)
    lb, gb = shard_loss_and_grad(cfg, samples[3:], 3, gt, gs)
    assert abs(loss4 - loss1) <= 1e-6 * abs(loss1) and _rel(grad4, grad1) <= 1e-6
    assert abs(la + lb - loss1) <= 1e-6 * abs(loss1) and _rel(ga + gb, grad1) <= 1e-6
    assert float(grad1.norm()) > 0


def test_reducer_values() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 1]])
    tm = build_reducer("token-mean")(loss, mask, global_tokens=6, global_seqs=4)
    sm = build_reducer("seq-mean-token-mean")(loss, mask, global_tokens=6, global_seqs=4)
    sn = build_reducer("seq-mean-token-sum-norm", 10)(loss, mask, global_tokens=6, global_seqs=4)
    assert float(tm) == pytest.approx(9 / 6)
    assert float(sm) == pytest.approx((1.5 + 6.0) / 4)
    assert float(sn) == pytest.approx(9 / 10 / 4)
    assert global_denominators([[0, 1, 1], [0, 0], [1]]) == (3, 2)
    with pytest.raises(ValueError, match="unknown loss reducer"):
        build_reducer("mean")
    with pytest.raises(ValueError, match="positive global token count"):
        REDUCERS["token-mean"](loss, mask, global_tokens=0, global_seqs=1)


# ----------------------------------------------------------------------------- real gloo


def _dist_worker(rank: int, world: int, port: int, shards: list[list[TrainSample]],
                 gt: int, gs: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        loss, grad = shard_loss_and_grad(CASES[1], shards[rank], 2, gt, gs)
        t = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(grad)  # a sum: the global denominators make it exact
        dist.all_reduce(t)
        if rank == 0:
            torch.save({"loss": float(t), "grad": grad}, os.path.join(out, "rank0.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_process(make_samples, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch.multiprocessing as mp

    samples = make_samples(8, seed=2, min_len=4, max_len=30, noise=0.3)
    gt, gs = global_denominators(s.mask for s in samples)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    shards = [samples[:5], samples[5:]]
    mp.spawn(_dist_worker, args=(2, port, shards, gt, gs, str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt")
    loss1, grad1 = shard_loss_and_grad(CASES[1], samples, 8, gt, gs)
    assert abs(got["loss"] - loss1) <= 1e-6 * abs(loss1)
    assert _rel(got["grad"], grad1) <= 1e-6
