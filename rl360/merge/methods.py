"""Pure per-tensor merge kernels (torch, fp32 in and out) following docs/merge-methods.md.

Every kernel takes the experts' task vectors tau_i = theta_i - theta_0 (same shape, fp32) and
returns `Merged(delta, mass)`: the merged delta (add it to theta_0) and, per expert, the L1 mass
of its contribution to that delta (the "share" in the summary). Kernels never modify their
inputs. Quantities that need a whole tensor or the whole model (TIES thresholds, RAM+ counts,
Gram matrices, DARE L1 factors) are passed in precomputed, so the runner can apply a kernel to
flat chunks of a tensor and keep its temporaries small.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch


class Merged(NamedTuple):
    delta: torch.Tensor
    mass: list[float]
    counts: tuple[int, ...] = ()  # a method's own additive counts (Stats.method_counts)


def _l1(t: torch.Tensor) -> float:
    import torch

    return float(torch.linalg.vector_norm(t, 1)) if t.numel() else 0.0


def linear(taus: Sequence[torch.Tensor], coefs: Sequence[float]) -> Merged:
    """delta = sum_i c_i tau_i."""
    import torch

    delta = torch.zeros_like(taus[0])
    for tau, c in zip(taus, coefs, strict=True):
        delta.add_(tau, alpha=float(c))
    return Merged(delta, [abs(float(c)) * _l1(tau) for tau, c in zip(taus, coefs, strict=True)])


def soup(taus: Sequence[torch.Tensor], weights: Sequence[float]) -> Merged:
    """Weighted model soup: theta = sum w_i theta_i / sum w_i (uniform soup: all w_i = 1)."""
    total = float(sum(weights))
    if abs(total) < 1e-8:
        raise ValueError("soup: the expert weights sum to 0")
    return linear(taus, [w / total for w in weights])


def task_arithmetic(
    taus: Sequence[torch.Tensor],
    weights: Sequence[float],
    lam: float = 1.0,
    normalize: bool = False,
) -> Merged:
    """theta = theta_0 + lam * sum w_i tau_i (divided by sum w_i when normalize; 0 -> 1)."""
    total = float(sum(weights)) if normalize else 1.0
    if abs(total) < 1e-8:
        total = 1.0
    return linear(taus, [lam * w / total for w in weights])


def trim(tau: torch.Tensor, threshold: float) -> torch.Tensor:
    """TIES trim: keep entries with |tau| >= threshold, zero the rest."""
    import torch

    return torch.where(tau.abs() >= threshold, tau, 0.0)


def ties_consensus(
    taus: Sequence[torch.Tensor],
    weights: Sequence[float],
    lam: float = 1.0,
    normalize: bool = True,
    zero_sign: float = 1.0,
) -> Merged:
    """TIES elect + disjoint mean on already-trimmed (or DARE-dropped) task vectors.

    gamma = sign(sum w_i tau_i), with gamma = zero_sign where the sum is 0 (the paper uses the
    model's majority sign; mergekit counts a zero sum as +). Experts whose (weighted) entry has
    sign gamma are averaged with divisor sum w_i over them (normalize), else summed.
    """
    import torch

    total = torch.zeros_like(taus[0])
    for tau, w in zip(taus, weights, strict=True):
        total.add_(tau, alpha=float(w))
    gamma = torch.sign(total)
    gamma[gamma == 0] = float(zero_sign)
    num = torch.zeros_like(total)
    div = torch.zeros_like(total)
    masks = []
    for tau, w in zip(taus, weights, strict=True):
        agree = (torch.sign(tau) * float(np.sign(w))) == gamma
        agree &= tau != 0
        num.add_(torch.where(agree, tau, 0.0), alpha=float(w))
        div.add_(agree.to(div.dtype), alpha=float(w))
        masks.append(agree)
    if normalize:
        div[div.abs() < 1e-8] = 1.0
    else:
        div.fill_(1.0)
    scale = lam / div
    delta = num.mul_(scale)
    mass = [
        _l1(torch.where(m, tau * scale, 0.0)) * abs(float(w))
        for tau, w, m in zip(taus, weights, masks, strict=True)
    ]
    return Merged(delta, mass)


def dare_drop(tau: torch.Tensor, keep: torch.Tensor, factor: float) -> torch.Tensor:
    """DARE: zero the dropped entries and rescale the survivors by `factor`."""
    import torch

    return torch.where(keep, tau * factor, 0.0)


def dare_l1_factor(tau: torch.Tensor, keep: torch.Tensor, eps: float = 1e-7) -> float:
    """mergekit's rescale: ||tau||_1 / ||kept tau||_1 (1 when either norm is < eps)."""
    import torch

    full = _l1(tau)
    kept = _l1(torch.where(keep, tau, 0.0))
    return full / kept if full >= eps and kept >= eps else 1.0


def dare_paper_factor(density: float) -> float:
    """The paper's rescale 1 / (1 - p), with p = 1 - density the drop rate."""
    return 1.0 / density


def active_masks(taus: Sequence[torch.Tensor], epsilon: float) -> list[torch.Tensor]:
    """RAM's active mask per expert: |tau_i| > epsilon."""
    return [tau.abs() > epsilon for tau in taus]


def ram(
    taus: Sequence[torch.Tensor],
    weights: Sequence[float] | None = None,
    epsilon: float = 1e-5,
    lambdas: Sequence[float] | None = None,
    masks: Sequence[torch.Tensor] | None = None,
) -> Merged:
    """RAM / RAM+: mean over active experts where c >= 2, lambda_j * tau_j where c == 1.

    `masks` overrides the epsilon gate (ULP-gate passes its step gate); `weights` scale each
    task vector after gating (1 by default); `lambdas` are RAM+'s unique-position rescales.
    """
    import torch

    n = len(taus)
    weights = [1.0] * n if weights is None else weights
    lambdas = [1.0] * n if lambdas is None else lambdas
    masks = active_masks(taus, epsilon) if masks is None else masks
    count = torch.zeros(taus[0].shape, dtype=torch.int32)
    for m in masks:
        count += m
    num = torch.zeros_like(taus[0])
    kept = []
    for tau, w, m in zip(taus, weights, masks, strict=True):
        kept.append(torch.where(m, tau, 0.0))
        num.add_(kept[-1], alpha=float(w))
    # divisor: c where c >= 2, 1 / lambda_j where only expert j is active, 1 where none is
    div = count.clamp(min=1).to(torch.float32)
    if any(lam != 1.0 for lam in lambdas):
        unique = count == 1
        for m, lam in zip(masks, lambdas, strict=True):
            div.masked_fill_(m & unique, 1.0 / float(lam))
    delta = num.div_(div)
    mass = [abs(float(w)) * _l1(k / div) for k, w in zip(kept, weights, strict=True)]
    return Merged(delta, mass)


def ram_counts(masks: Sequence[torch.Tensor]) -> tuple[list[int], list[int]]:
    """RAM+ counts per expert j: S_j = #(j active, c >= 2), U_j = #(j active, c == 1)."""
    import torch

    count = torch.zeros(masks[0].shape, dtype=torch.int32)
    for m in masks:
        count += m
    shared = [int((m & (count >= 2)).sum()) for m in masks]
    unique = [int((m & (count == 1)).sum()) for m in masks]
    return shared, unique


def ram_plus_lambdas(
    shared: Sequence[int], unique: Sequence[int], rescale_factor: float = 1.2, alpha: float = 1.0
) -> list[float]:
    """lambda_j = 1 + (r - 1) * min(alpha, S_j / U_j).

    Official RAM+: alpha = 1, r = 1.2. mergekit's ramplus_tl(r', alpha) is r = 1 + r'.
    U_j = 0 means expert j has no unique position, so its lambda is never used: it gets the
    cap (the official code raises ZeroDivisionError there instead).
    """
    out = []
    for s, u in zip(shared, unique, strict=True):
        rho = s / u if u > 0 else (float("inf") if s > 0 else 0.0)
        out.append(1.0 + (rescale_factor - 1.0) * min(alpha, rho))
    return out


def gram_matrix(taus: Sequence[torch.Tensor]) -> np.ndarray:
    """G_ij = <tau_i, tau_j> in float64 (additive over chunks of the tensor)."""
    flat = [t.reshape(-1).double() for t in taus]
    n = len(flat)
    g = np.zeros((n, n), dtype=np.float64)
    for i in range(n):
        for j in range(i, n):
            g[i, j] = g[j, i] = float(flat[i] @ flat[j])
    return g


def cosines(gram: np.ndarray) -> np.ndarray:
    """C_ij = G_ij / (|tau_i| |tau_j|), 0 where a norm is 0, C_ii = 1."""
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    denom = np.outer(norms, norms)
    c = np.divide(gram, denom, out=np.zeros_like(gram), where=denom > 0)
    np.fill_diagonal(c, 1.0)
    return c


def gram_multiplicity(gram: np.ndarray) -> np.ndarray:
    """Gram-soup soft multiplicity m_i = sum_j max(0, C_ij), in [1, N]."""
    return np.clip(cosines(gram), 0.0, None).sum(axis=1)


def gram_soup(
    taus: Sequence[torch.Tensor],
    weights: Sequence[float] | None = None,
    lam: float = 1.0,
    gram: np.ndarray | None = None,
) -> Merged:
    """Gram-soup (adopted, spec section 8): delta = lam * sum_i w_i tau_i / m_i."""
    weights = [1.0] * len(taus) if weights is None else weights
    m = gram_multiplicity(gram_matrix(taus) if gram is None else gram)
    return linear(taus, [lam * w / float(mi) for w, mi in zip(weights, m, strict=True)])


def model_stock_t(gram: np.ndarray) -> float:
    """Model Stock ratio t = N cos / (1 + (N - 1) cos), cos = mean pairwise cosine."""
    n = gram.shape[0]
    if n < 2:
        raise ValueError("model_stock needs at least 2 experts")
    c = cosines(gram)
    cos = float(c[np.triu_indices(n, 1)].mean())
    return n * cos / (1.0 + (n - 1) * cos)


def model_stock(
    taus: Sequence[torch.Tensor],
    weights: Sequence[float] | None = None,
    gram: np.ndarray | None = None,
) -> Merged:
    """Model Stock (mergekit, unclamped t): delta = t * weighted mean of tau_i."""
    weights = [1.0] * len(taus) if weights is None else weights
    t = model_stock_t(gram_matrix(taus) if gram is None else gram)
    total = float(sum(weights))
    return linear(taus, [t * w / total for w in weights])
