"""Isotropic merging (Marczak et al., ICML 2025): Iso-C and Iso-CTS on 2-D weight matrices.

The SVDs run in float64 (the inputs stay fp32), so results do not depend on how LAPACK
splits work across threads beyond float64 rounding, and match the spec's vectors to 1e-6.
Callers average non-2-D tensors (and embeddings) instead, see `strategies.Iso`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rl360.merge.methods import Merged, _l1

if TYPE_CHECKING:
    import torch


def _shares(
    taus: Sequence[torch.Tensor], weights: Sequence[float], delta: torch.Tensor
) -> list[float]:
    """A nonlinear merge has no per-expert terms: report |<w_i tau_i, delta>| / |tau_i|,
    the length of the merged delta's projection on each task vector, scaled to delta's L1."""
    import torch

    proj = []
    for tau, w in zip(taus, weights, strict=True):
        norm = float(torch.linalg.vector_norm(tau))
        proj.append(
            abs(float(w) * float((tau.double() * delta.double()).sum())) / norm if norm else 0.0
        )
    total = sum(proj)
    l1 = _l1(delta)
    return [p / total * l1 if total else 0.0 for p in proj]


def _polar(a: torch.Tensor) -> torch.Tensor:
    """The orthogonal polar factor of a (A Sigma B^T -> A B^T)."""
    import torch

    u, _, vh = torch.linalg.svd(a, full_matrices=False)
    return u @ vh


def iso_c(
    taus: Sequence[torch.Tensor], weights: Sequence[float] | None = None, alpha: float = 1.0
) -> Merged:
    """Iso-C: SVD of sum_i w_i tau_i, all singular values replaced by their mean, times alpha."""
    import torch

    weights = [1.0] * len(taus) if weights is None else weights
    total = torch.zeros(taus[0].shape, dtype=torch.float64)
    for tau, w in zip(taus, weights, strict=True):
        total.add_(tau.double(), alpha=float(w))
    u, s, vh = torch.linalg.svd(total, full_matrices=False)
    del total
    delta = ((u * (s.mean() * alpha)) @ vh).to(torch.float32)
    return Merged(delta, _shares(taus, weights, delta))


def cts_sizes(rows: int, cols: int, n: int, common_space_fraction: float) -> tuple[int, int]:
    """(k common directions, d task-specific directions per expert), as the official code.

    k = int(r * f); the task-specific total r - k is rounded (Python round) to a multiple of n,
    then k = r - total. A total that would exceed r is reduced by n.
    """
    r = min(rows, cols)
    k = int(r * common_space_fraction)
    total = round((r - k) / n) * n
    while total > r:
        total -= n
    return r - total, total // n


def iso_cts(
    taus: Sequence[torch.Tensor],
    weights: Sequence[float] | None = None,
    alpha: float = 1.0,
    common_space_fraction: float = 0.8,
) -> Merged:
    """Iso-CTS: common subspace of sum tau_i plus d task-specific directions per expert."""
    import torch

    n = len(taus)
    weights = [1.0] * n if weights is None else weights
    rows, cols = taus[0].shape
    k, d = cts_sizes(rows, cols, n, common_space_fraction)
    total = torch.zeros((rows, cols), dtype=torch.float64)
    for tau, w in zip(taus, weights, strict=True):
        total.add_(tau.double(), alpha=float(w))
    u, s, vh = torch.linalg.svd(total, full_matrices=False)
    del total
    uc, sc, vc = u[:, :k], s[:k], vh[:k, :]
    del u, s, vh
    us, ss, vs = [], [], []
    for tau, w in zip(taus, weights, strict=True):
        wtau = tau.double() * float(w)
        perp = wtau - uc @ (uc.T @ wtau)
        del wtau
        ut, st, vt = torch.linalg.svd(perp, full_matrices=False)
        us.append(ut[:, :d])
        ss.append(st[:d])
        vs.append(vt[:d, :])
    u_all = _polar(torch.cat([*us, uc], dim=1))
    v_all = _polar(torch.cat([*vs, vc], dim=0))
    s_mean = torch.cat([*ss, sc]).mean()
    delta = ((u_all * (s_mean * alpha)) @ v_all).to(torch.float32)
    return Merged(delta, _shares(taus, weights, delta))


def cts_spectrum(taus: Sequence[torch.Tensor], common_space_fraction: float = 0.8) -> torch.Tensor:
    """s_all of Iso-CTS (task-specific blocks, then the common block), for tests and reports."""
    import torch

    n = len(taus)
    rows, cols = taus[0].shape
    k, d = cts_sizes(rows, cols, n, common_space_fraction)
    wt = [tau.double() for tau in taus]
    u, s, _ = torch.linalg.svd(sum(wt), full_matrices=False)
    parts = [torch.linalg.svdvals(t - u[:, :k] @ (u[:, :k].T @ t))[:d] for t in wt]
    return torch.cat([*parts, s[:k]])
