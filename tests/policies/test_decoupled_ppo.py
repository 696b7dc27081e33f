"""Decoupled PPO (docs/off-policy.md): the ratio is current/proximal and is clipped, the importance weight
proximal/behaviour is truncated; several optimizer steps per batch; the staleness guardrail."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
import torch

from rl360.policies.losses import build_policy_loss
from rl360.policies.trainer_torch import TorchTrainer
from rl360.recipe import LossSection, RecipeError, TrainerSection, decode_recipe
from rl360.types import Batch


def test_ratio_and_weights_on_hand_computed_tensors() -> None:
    # one sequence, three loss tokens: fresh (sampled by the proximal policy itself), stale
    # (sampled by an older policy 0.5 nats less likely) and very stale (weight truncated)
    proximal = torch.tensor([[-1.0, -2.0, -3.0]])
    behaviour = torch.tensor([[-1.0, -2.5, -4.0]])
    current = torch.tensor([[-1.0 + math.log(1.5), -2.0 + math.log(0.9), -3.0]],
                           requires_grad=True)
    mask = torch.ones(1, 3)
    adv = torch.tensor([1.0])
    loss_fn = build_policy_loss(LossSection(name="ppo", eps_low=0.2, eps_high=0.28, tis_cap=2.0))
    per_token, m = loss_fn(current, proximal, behaviour, adv, mask)
    ratio = [1.5, 0.9, 1.0]  # current / proximal
    weight = [1.0, math.exp(0.5), 2.0]  # min(proximal / behaviour, 2): exp(1) is truncated
    # A > 0: -A * min(ratio, clip(ratio)) * weight; the first ratio is clipped at 1 + 0.28
    expected = [-min(r, min(max(r, 0.8), 1.28)) * w for r, w in zip(ratio, weight, strict=True)]
    assert expected[0] == pytest.approx(-1.28)
    assert per_token.detach()[0].tolist() == pytest.approx(expected, rel=1e-6)
    per_token.sum().backward()
    grad = current.grad[0].tolist()  # type: ignore[union-attr]
    assert grad[0] == 0.0  # the clipped token carries no gradient
    assert grad[1] == pytest.approx(-0.9 * math.exp(0.5), rel=1e-6)
    assert grad[2] == pytest.approx(-1.0 * 2.0, rel=1e-6)
    assert float(m["clip_frac"]) == pytest.approx(1 / 3)
    assert float(m["tis_capped_frac"]) == pytest.approx(1 / 3)
    raw = torch.tensor([1.0, math.exp(0.5), math.exp(1.0)])
    assert float(m["is_ess_frac"]) == pytest.approx(float(raw.sum() ** 2 / (3 * (raw**2).sum())))
    d = torch.tensor([0.0, 0.5, 1.0])
    assert float(m["sampler_kl"]) == pytest.approx(float((d.exp() - d - 1).mean()), rel=1e-6)


def test_several_steps_per_batch_clip_against_the_proximal_policy(
    tiny_dir: Path, make_samples  # type: ignore[no-untyped-def]
) -> None:
    batch = Batch(samples=make_samples(12, seed=5, max_len=30, noise=0.3))
    one = TorchTrainer(TrainerSection(lr=3e-2), tiny_dir).train_step(batch)
    assert one["optimizer_steps"] == 1.0 and one["clip_frac"] == 0.0  # ratio == 1 throughout
    many = TorchTrainer(TrainerSection(lr=3e-2, minibatches=2, epochs=2), tiny_dir)
    m = many.train_step(batch)
    assert m["optimizer_steps"] == 4.0 and many.step == 4
    assert m["clip_frac"] > 0.0  # later steps move the ratio out of [0.8, 1.28]


def test_a_minibatch_step_does_not_depend_on_the_micro_batch_split(
    tiny_dir: Path, make_samples  # type: ignore[no-untyped-def]
) -> None:
    batch = Batch(samples=make_samples(10, seed=3, max_len=40, noise=0.3))
    results = []
    for micro in (16, 2):
        t = TorchTrainer(TrainerSection(lr=1e-3, micro_batch_size=micro, minibatches=2,
                                        epochs=2), tiny_dir)
        m = t.train_step(batch)
        results.append((m["loss"], {k: v.detach().clone() for k, v in t.model.state_dict().items()}))
    (l1, w1), (l2, w2) = results
    assert l1 == pytest.approx(l2, rel=1e-5)
    # Adam divides by sqrt(v): where a gradient is ~1e-8, float summation-order noise between
    # the two splits moves that weight by up to ~1e-5 after 4 steps (seen: 1.04e-5); a wrong
    # split (a micro batch weighted by its own token count) moves weights by ~lr = 1e-3
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-4


@pytest.mark.parametrize("loss", [{"name": "reinforce"}, {"name": "ppo", "tis_cap": 0.0}])
def test_off_policy_training_without_clip_or_truncation_is_refused(loss: dict) -> None:
    with pytest.raises(RecipeError) as err:
        decode_recipe({"train": {"max_staleness": 2}, "trainer": {"loss": loss}})
    text = str(err.value)
    assert "\n" not in text and text.startswith("trainer.loss: train.max_staleness = 2")
    decode_recipe({"train": {"max_staleness": 0}, "trainer": {"loss": loss}})  # on-policy: fine


def test_the_default_recipe_is_off_policy_safe() -> None:
    r = decode_recipe({})
    assert r.train.max_staleness > 0 and r.trainer.loss.name == "ppo" and r.trainer.loss.tis_cap >= 1
    assert msgspec.to_builtins(r.trainer)["minibatches"] == 1
