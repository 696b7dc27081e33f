"""Policy losses as pure functions of tensors: values, gradients, clipping, TIS, KL."""

from __future__ import annotations

import math
import re

import pytest
import torch

from rl360.policies.losses import (
    behaviour_clip_mask,
    build_policy_loss,
    entropy_from_logits,
    gspo_loss,
    kl_k1,
    kl_k3,
    ppo_clip_loss,
    reinforce_loss,
    sequence_mask,
    tis_weights,
)
from rl360.recipe import LossSection, checked


def _leaf(x: list[list[float]]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64, requires_grad=True)


def test_ppo_at_ratio_one_is_the_policy_gradient() -> None:
    logp = _leaf([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([0.5, -2.0])
    loss, m = ppo_clip_loss(logp, logp.detach(), adv, mask, eps_low=0.2, eps_high=0.28)
    loss.sum().backward()
    expected = (-adv.unsqueeze(1) * mask).double()
    assert torch.allclose(logp.grad, expected)
    assert float(m["clip_frac"]) == 0.0 and float(m["ratio_mean"]) == pytest.approx(1.0)
    assert float(loss[1, 2]) == 0.0


@pytest.mark.parametrize(
    ("log_ratio", "adv", "clipped"),
    [
        (math.log(1.25), 1.0, False),  # inside the higher bound 1.28
        (math.log(1.30), 1.0, True),  # above it, positive advantage: no gradient
        (math.log(1.30), -1.0, False),  # above it, negative advantage: keeps the gradient
        (math.log(0.81), -1.0, False),  # inside the lower bound 0.8
        (math.log(0.79), -1.0, True),  # below it, negative advantage: no gradient
        (math.log(0.79), 1.0, False),
    ],
)
def test_ppo_clip_higher_is_asymmetric(log_ratio: float, adv: float, clipped: bool) -> None:
    old = torch.tensor([[-1.0]])
    logp = _leaf([[-1.0 + log_ratio]])
    loss, m = ppo_clip_loss(logp, old, torch.tensor([adv]), torch.ones(1, 1), eps_low=0.2,
                            eps_high=0.28)
    loss.sum().backward()
    ratio = math.exp(log_ratio)
    if clipped:
        assert float(logp.grad) == 0.0 and float(m["clip_frac"]) == 1.0
        bound = 1.28 if adv > 0 else 0.8
        assert float(loss) == pytest.approx(-adv * bound)
    else:
        assert float(logp.grad) == pytest.approx(-adv * ratio)
        assert float(m["clip_frac"]) == 0.0


def test_gspo_uses_one_clipped_ratio_per_sequence() -> None:
    torch.manual_seed(0)
    old = -torch.rand(2, 5) - 0.5
    delta = torch.tensor([[0.05, -0.02, 0.3, 0.0, 9.0], [0.5, 0.5, 0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    logp = (old + delta).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0])
    loss, m = gspo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    seq0 = math.exp((0.05 - 0.02 + 0.3 + 0.0) / 4)  # the masked 9.0 is ignored
    assert torch.allclose(loss[0, :4], torch.full((4,), -seq0))
    assert float(loss[0, 4]) == 0.0
    assert torch.allclose(loss[1], torch.full((5,), -1.28))  # exp(0.5) > 1.28: clipped
    # gradient of the per-sequence mean equals the gradient of -A * exp(mean log-ratio)
    per_seq = (loss * mask).sum(1) / mask.sum(1)
    per_seq[0].backward()
    ref = logp.detach().clone().requires_grad_(True)
    lr = ((ref - old) * mask)[0, :4].mean()
    (-torch.exp(lr)).backward()
    assert torch.allclose(logp.grad[0], ref.grad[0])
    assert float(m["clip_frac"]) == pytest.approx(5 / 9)


def test_reinforce_is_minus_advantage_times_logprob() -> None:
    logp = _leaf([[-1.0, -2.0]])
    loss, _ = reinforce_loss(logp, logp.detach(), torch.tensor([3.0]), torch.tensor([[0, 1]]))
    assert loss.tolist() == [[0.0, 6.0]]


def test_tis_weight_is_capped_detached_and_reported() -> None:
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    samp = torch.tensor([[-1.0, -1.5, -2.0, math.inf]])  # inf sits on a masked token
    mask = torch.tensor([[1, 1, 1, 0]])
    w, m = tis_weights(old, samp, mask, cap=1.5)
    assert w[0].tolist() == pytest.approx([1.0, 1.5, 1.5, 0.0])
    assert not w.requires_grad
    assert float(m["tis_capped_frac"]) == pytest.approx(2 / 3)
    assert float(m["mismatch_abs_mean"]) == pytest.approx(0.5)
    assert float(m["mismatch_abs_max"]) == pytest.approx(1.0)
    w0, _ = tis_weights(old, samp, mask, cap=0.0)
    assert w0.tolist() == [[1.0, 1.0, 1.0, 0.0]]
    ws, _ = tis_weights(old, samp, mask, cap=10.0, level="sequence")
    assert ws[0, :3].tolist() == pytest.approx([math.exp(0.5)] * 3)


def test_composed_loss_weights_the_gradient_by_tis() -> None:
    logp = _leaf([[-1.0, -1.0, -1.0]])
    samp = torch.tensor([[-1.0, -1.2, -3.0]])
    mask = torch.ones(1, 3)
    loss_fn = build_policy_loss(LossSection(name="ppo", tis_cap=2.0))
    loss, m = loss_fn(logp, None, samp, torch.tensor([1.0]), mask)
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -math.exp(0.2), -2.0])
    assert {"pg_loss", "clip_frac", "tis_capped_frac", "mismatch_abs_mean"} <= set(m)
    assert "kl" not in m


def test_sequence_mask_drops_whole_sequences_sampled_far_from_the_proximal_policy() -> None:
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0],
                        [-1.0, -1.0, -1.0, -1.0]])
    # mean log-ratio old - sampling over the loss tokens: 0.5 (masked at 0.3), -0.1 (kept;
    # its last token is off the mask and would read -2.9), -0.4 (masked)
    samp = torch.tensor([[-1.5, -1.5, -1.5, -1.5], [-0.9, -0.9, -0.9, 2.0],
                         [-0.6, -0.6, -0.6, -0.6]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    keep, m = sequence_mask(old, samp, mask, 0.3)
    assert keep.tolist() == [[0.0], [1.0], [0.0]]
    assert float(m["seq_masked_frac"]) == pytest.approx(6 / 9)
    assert float(m["seq_log_ratio_abs_max"]) == pytest.approx(0.5)
    # in the composed loss: the masked sequences get no gradient, the kept one its TIS weight
    logp = _leaf(old.tolist())
    loss_fn = build_policy_loss(LossSection(name="ppo", tis_cap=2.0, seq_mask=0.3))
    loss, lm = loss_fn(logp, None, samp, torch.tensor([1.0, 1.0, 1.0]), mask)
    loss.sum().backward()
    assert logp.grad[0].tolist() == [0.0] * 4 and logp.grad[2].tolist() == [0.0] * 4
    assert logp.grad[1].tolist() == pytest.approx([-math.exp(-0.1)] * 3 + [0.0])
    assert float(lm["seq_masked_frac"]) == pytest.approx(6 / 9)
    # off by default: every sequence keeps its (truncated) per-token weight
    logp.grad = None
    loss, lm = build_policy_loss(LossSection(name="ppo", tis_cap=2.0))(
        logp, None, samp, torch.tensor([1.0, 1.0, 1.0]), mask)
    loss.sum().backward()
    assert "seq_masked_frac" not in lm
    assert logp.grad[0].tolist() == pytest.approx([-math.exp(0.5)] * 4)
    with pytest.raises(ValueError, match="seq_mask"):
        checked(LossSection, seq_mask=-0.1)


def test_behaviour_clip_stops_pushing_tokens_already_moved_past_the_clip_range() -> None:
    old = torch.full((2, 4), -1.0)
    # log-ratio old - sampling per token: +0.5 (ratio 1.65), +0.1 (1.11), -0.5 (0.61), +0.5
    # (the last one off the mask). Row 0 has A > 0: its first token was already pushed up past
    # 1 + eps_high = 1.28 and is clipped; row 1 has A < 0: its -0.5 token (down past 0.8) is.
    samp = torch.tensor([[-1.5, -1.1, -0.5, -1.5], [-1.5, -1.1, -0.5, -1.5]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    adv = torch.tensor([1.0, -1.0])
    keep, m = behaviour_clip_mask(old, samp, adv, mask, eps_low=0.2, eps_high=0.28)
    assert keep.tolist() == [[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    assert float(m["behaviour_clip_frac"]) == pytest.approx(2 / 6)
    # composed: a kept token keeps its TIS weight, a clipped one gets no gradient
    logp = _leaf(old.tolist())
    loss_fn = build_policy_loss(LossSection(name="ppo", tis_cap=2.0, behaviour_clip=True))
    loss, lm = loss_fn(logp, None, samp, adv, mask)
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, -math.exp(0.1), -math.exp(-0.5), 0.0])
    assert logp.grad[1].tolist() == pytest.approx([math.exp(0.5), math.exp(0.1), 0.0, 0.0])
    assert float(lm["behaviour_clip_frac"]) == pytest.approx(2 / 6)
    # fresh tokens (ratio 1 up to the engine mismatch) are never clipped; off by default
    keep, m = behaviour_clip_mask(old, old + 1e-4, adv, mask, eps_low=0.2, eps_high=0.28)
    assert keep.tolist() == mask.float().tolist() and float(m["behaviour_clip_frac"]) == 0.0
    _, lm = build_policy_loss(LossSection(name="ppo", tis_cap=2.0))(logp, None, samp, adv, mask)
    assert "behaviour_clip_frac" not in lm


def test_masked_tokens_carry_no_loss_and_no_gradient() -> None:
    logp = _leaf([[-1.0, 50.0, -1.0]])
    old = torch.tensor([[-1.0, -50.0, -1.0]])
    samp = torch.tensor([[-1.0, math.nan, -1.0]])
    mask = torch.tensor([[1, 0, 1]])
    for name in ("ppo", "gspo", "reinforce"):
        logp.grad = None
        loss, m = build_policy_loss(name=name)(logp, old, samp, torch.tensor([1.0]), mask)
        loss.sum().backward()
        assert torch.isfinite(loss).all() and float(loss[0, 1]) == 0.0
        assert float(logp.grad[0, 1]) == 0.0 and torch.isfinite(logp.grad).all()
        assert all(math.isfinite(float(v)) for v in m.values())


def test_kl_estimators_and_penalty() -> None:
    logp = _leaf([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    assert kl_k1(logp, ref)[0].tolist() == pytest.approx([0.5, 0.0])
    d = -0.5
    assert kl_k3(logp, ref)[0].tolist() == pytest.approx([math.exp(d) - d - 1, 0.0])
    loss_fn = build_policy_loss(name="reinforce", kl_coef=0.1, kl_estimator="k1")
    loss, m = loss_fn(logp, None, None, torch.tensor([0.0]), torch.ones(1, 2), ref)
    assert loss[0].tolist() == pytest.approx([0.05, 0.0])
    assert float(m["kl"]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        loss_fn(logp, None, None, torch.tensor([0.0]), torch.ones(1, 2))


def test_entropy_from_logits() -> None:
    z = torch.zeros(2, 3, 320)
    assert torch.allclose(entropy_from_logits(z), torch.full((2, 3), math.log(320)))
    z[..., 7] = 100.0
    assert float(entropy_from_logits(z).max()) < 1e-6


def test_loss_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match=re.escape("name: expected one of 'gspo', 'ppo', 'reinforce', got 'dpo'")):
        checked(LossSection, name="dpo")
    with pytest.raises(ValueError, match="tis_cap"):
        checked(LossSection, tis_cap=0.5)
    with pytest.raises(ValueError, match="kl_estimator"):
        build_policy_loss(kl_estimator="k2")
