"""Policy losses: pure functions of tensors, per token.

Inputs share one [B, T] shape (T = target positions): `logprobs` (current policy, with grad),
`old_logprobs` (the policy the step starts from, no grad), `sampling_logprobs` (what the
engines reported when they sampled), `advantages` ([B] or [B, T]), `mask` (1 on loss tokens).
Each loss returns (per-token loss [B, T], zero off the mask; metrics). A reducer
(rl360.policies.reducers) turns the per-token loss into a scalar with global denominators.

Metrics are 0-dim detached tensors. Convention for aggregating them over micro-batches and
ranks: a key ending in "_max" is a maximum; every other key is a mean over loss tokens.

Truncated importance sampling (TIS): the engines sample with their own numerics, so their
logprobs differ from the trainer's. The policy-gradient term of each token is weighted by
min(exp(old - sampling), tis_cap), detached; the mismatch itself is always reported. With
`seq_mask` > 0 a sequence whose mean log-ratio old - sampling is out of bounds is masked whole.
With `behaviour_clip` a token that the steps since its sampling already moved beyond the clip
range in its advantage's direction (old / sampling > 1 + eps_high with A > 0, < 1 - eps_low with
A < 0) gets no gradient: PPO's trust region measured from the behaviour policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec
import torch
from torch import Tensor

from rl360.recipe import LossSection, checked

Metrics = dict[str, Tensor]
BaseLoss = Callable[..., tuple[Tensor, Metrics]]

_MAX_LOG_RATIO = 20.0  # exp() guard; a log-ratio this large is clipped away anyway


# ----------------------------------------------------------------------------- helpers


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    if not bool(mask.any()):
        return x.new_zeros(())
    return x[mask.bool()].max()


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask is set, 0 elsewhere (no inf * 0 = nan)."""
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def _seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """[B, 1]: each row's mean of x (already zero off the mask) over its loss tokens."""
    return x.sum(dim=1, keepdim=True) / mask.to(x.dtype).sum(dim=1, keepdim=True).clamp(min=1.0)


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    return advantages.to(like.dtype).expand_as(like)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dim: logsumexp(z) - sum(p * z)."""
    z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Schulman's k3: exp(ref - logp) - (ref - logp) - 1 (unbiased, always >= 0)."""
    d = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(d) - d - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k3": kl_k3}


def tis_weights(
    old_logprobs: Tensor,
    sampling_logprobs: Tensor,
    mask: Tensor,
    cap: float,
    level: Literal["token", "sequence"] = "token",
) -> tuple[Tensor, Metrics]:
    """min(exp(old - sampling), cap), detached (ones when cap is 0), plus mismatch metrics."""
    diff = _masked((old_logprobs - sampling_logprobs).detach(), mask)
    if level == "sequence":  # geometric mean over the sequence's loss tokens
        diff_used = _seq_mean(diff, mask).expand_as(diff)
    else:
        diff_used = diff
    raw = torch.exp(diff_used.clamp(max=_MAX_LOG_RATIO))
    if cap > 0:
        w = _masked(raw.clamp(max=cap), mask)
        capped = (raw > cap).to(diff.dtype)
    else:
        w = mask.to(diff.dtype)
        capped = torch.zeros_like(diff)
    m = mask.to(diff.dtype)
    raw_m = raw * m
    n = m.sum().clamp(min=1.0)
    metrics = {
        "mismatch_abs_mean": masked_mean(diff.abs(), mask),
        "mismatch_abs_max": masked_max(diff.abs(), mask),
        "tis_capped_frac": masked_mean(capped, mask),
        "tis_weight_mean": masked_mean(w, mask),
        # effective sample size of the untruncated weights, as a fraction of the tokens
        "is_ess_frac": raw_m.sum() ** 2 / ((raw_m**2).sum().clamp(min=1e-30) * n),
        # KL(behaviour || proximal) per token, k3 estimate from the behaviour's samples
        "sampler_kl": masked_mean(torch.exp(diff.clamp(max=_MAX_LOG_RATIO)) - diff - 1.0, mask),
    }
    return w, metrics


def sequence_mask(
    old_logprobs: Tensor, sampling_logprobs: Tensor, mask: Tensor, bound: float
) -> tuple[Tensor, Metrics]:
    """[B, 1], detached: 1 for a sequence whose mean log-ratio old - sampling over its loss
    tokens lies within [-bound, bound], else 0. A token's TIS weight is truncated, which caps
    how far one token can push; a sequence whose tokens are off the proximal policy as a whole
    (one sampled by weights the trainer has moved far from) is left out instead of reweighted.
    Metrics: the share of loss tokens in masked sequences, the largest |mean log-ratio|."""
    m = mask.to(old_logprobs.dtype)
    seq = _seq_mean(_masked((old_logprobs - sampling_logprobs).detach(), mask), mask)
    n = m.sum(dim=1, keepdim=True)
    keep = (seq.abs() <= bound).to(seq.dtype)
    has = n > 0
    metrics = {
        "seq_masked_frac": ((1.0 - keep) * n).sum() / m.sum().clamp(min=1.0),
        "seq_log_ratio_abs_max": seq.abs()[has].max() if bool(has.any()) else seq.new_zeros(()),
    }
    return keep, metrics


def behaviour_clip_mask(
    old_logprobs: Tensor, sampling_logprobs: Tensor, advantages: Tensor, mask: Tensor,
    eps_low: float, eps_high: float, level: Literal["token", "sequence"] = "token",
) -> tuple[Tensor, Metrics]:
    """[B, T], detached: 0 on a token whose ratio old / sampling (the proximal policy over the
    one that sampled it) already lies beyond the clip range in its advantage's direction, else
    1. That is PPO's clip with the behaviour policy as the old one, evaluated where the step
    starts: with one optimizer step per batch the proximal clip never acts, and a batch sampled
    a version back would push again what the step in between already pushed (a delayed
    feedback loop that overshoots). `level="sequence"` uses the sequence's mean log-ratio.
    Metric: the share of loss tokens it zeroes."""
    diff = _masked((old_logprobs - sampling_logprobs).detach(), mask)
    if level == "sequence":
        diff = _seq_mean(diff, mask).expand_as(diff)
    ratio = torch.exp(diff.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    adv = _per_token(advantages, old_logprobs).detach()
    out = ((ratio > 1.0 + eps_high) & (adv > 0)) | ((ratio < 1.0 - eps_low) & (adv < 0))
    keep = _masked(1.0 - out.to(diff.dtype), mask)
    return keep, {"behaviour_clip_frac": masked_mean(out.to(diff.dtype), mask)}


# ----------------------------------------------------------------------------- base losses


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[Tensor, Metrics]:
    """PPO-clip with asymmetric bounds (clip-higher): ratio in [1 - eps_low, 1 + eps_high]."""
    adv = _per_token(advantages, logprobs)
    log_ratio = _masked(logprobs - old_logprobs.detach(), mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return _clipped_objective(torch.exp(log_ratio), adv, mask, eps_low, eps_high)


def _clipped_objective(
    ratio: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Metrics]:
    """The PPO clipped surrogate per token, shared by token-level (PPO) and sequence-level
    (GSPO) ratios, with its clip-fraction metrics."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = _masked(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        low = ((ratio < 1.0 - eps_low) & (adv < 0)).to(ratio.dtype)
        high = ((ratio > 1.0 + eps_high) & (adv > 0)).to(ratio.dtype)
        metrics = {
            "clip_frac": masked_mean(low + high, mask),
            "clip_frac_low": masked_mean(low, mask),
            "clip_frac_high": masked_mean(high, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[Tensor, Metrics]:
    """GSPO: one ratio per sequence, exp(mean of the token log-ratios over its loss tokens),
    clipped like PPO. Written per token as exp(sg[s] + logp - sg[logp]): every token carries
    the sequence's value and the gradient of the sequence ratio."""
    adv = _per_token(advantages, logprobs)
    log_ratio = _masked(logprobs - old_logprobs.detach(), mask)
    seq = _seq_mean(log_ratio, mask)
    tok_log_ratio = seq.detach() + logprobs - logprobs.detach()
    ratio = torch.exp(_masked(tok_log_ratio, mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return _clipped_objective(ratio, adv, mask, eps_low, eps_high)


def reinforce_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, **_: float
) -> tuple[Tensor, Metrics]:
    """Plain policy gradient: -A * logp (old_logprobs only feed the TIS weight)."""
    adv = _per_token(advantages, logprobs)
    return _masked(-adv * logprobs, mask), {}


POLICY_LOSSES: dict[str, BaseLoss] = {
    "ppo": ppo_clip_loss,
    "gspo": gspo_loss,
    "reinforce": reinforce_loss,
}


# ----------------------------------------------------------------------------- composed


class PolicyLoss:
    """The configured loss: base loss x TIS weight (+ kl_coef x KL to a reference)."""

    def __init__(self, config: LossSection) -> None:
        self.config = config
        self.base = POLICY_LOSSES[config.name]
        self.kl = KL_ESTIMATORS[config.kl_estimator]
        self.tis_level: Literal["token", "sequence"] = (
            "sequence" if config.name == "gspo" else "token"
        )

    @property
    def needs_reference(self) -> bool:
        return self.config.kl_coef > 0

    def __call__(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor | None,
        sampling_logprobs: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        ref_logprobs: Tensor | None = None,
    ) -> tuple[Tensor, Metrics]:
        c = self.config
        if old_logprobs is None:  # one optimizer step per batch: old == current, detached
            old_logprobs = logprobs.detach()
        shapes = {tuple(t.shape) for t in (logprobs, old_logprobs, mask)}
        if sampling_logprobs is not None:
            shapes.add(tuple(sampling_logprobs.shape))
        if len(shapes) != 1:
            raise ValueError(f"policy loss inputs disagree on shape: {sorted(shapes)}")
        loss, metrics = self.base(
            logprobs, old_logprobs, advantages, mask, eps_low=c.eps_low, eps_high=c.eps_high
        )
        metrics["pg_loss"] = masked_mean(loss.detach(), mask)
        if sampling_logprobs is not None:
            w, tis_metrics = tis_weights(old_logprobs, sampling_logprobs, mask, c.tis_cap,
                                         self.tis_level)
            loss = loss * w
            metrics.update(tis_metrics)
            if c.seq_mask > 0:
                keep, seq_metrics = sequence_mask(old_logprobs, sampling_logprobs, mask,
                                                  c.seq_mask)
                loss = loss * keep
                metrics.update(seq_metrics)
            if c.behaviour_clip:
                keep_tok, bc_metrics = behaviour_clip_mask(
                    old_logprobs, sampling_logprobs, advantages, mask, c.eps_low, c.eps_high,
                    self.tis_level)
                loss = loss * keep_tok
                metrics.update(bc_metrics)
        if ref_logprobs is not None:
            kl = _masked(self.kl(logprobs, ref_logprobs.detach()), mask)
            metrics["kl"] = masked_mean(kl.detach(), mask)
            if c.kl_coef > 0:
                loss = loss + c.kl_coef * kl
        elif c.kl_coef > 0:
            raise ValueError(f"kl_coef={c.kl_coef} needs ref_logprobs from a reference policy")
        return loss, metrics


def build_policy_loss(config: LossSection | None = None, **overrides: object) -> PolicyLoss:
    """`build_policy_loss(LossSection(name="gspo"))` or `build_policy_loss(name="gspo")`;
    overrides are checked against the section's bounds like a recipe's values."""
    config = config or LossSection()
    if overrides:
        config = checked(LossSection, **{**msgspec.to_builtins(config), **overrides})
    return PolicyLoss(config)
