"""The torch trainer on the tiny model: micro-batch invariance, a REINFORCE sanity check,
old == current, TIS/mismatch metrics, KL, bf16, sync state dict, save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl360.policies.advantages import build_advantage
from rl360.policies.trainer_torch import TorchTrainer
from rl360.recipe import LossSection, TrainerSection, checked
from rl360.types import Batch, TrainSample


def teacher_forced(model, tokens: list[int]) -> list[float]:  # type: ignore[no-untyped-def]
    """logprob of each token given the ones before it (0.0 for the first)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1))
    return [0.0, *lp.squeeze(-1).tolist()]


def completion_logprob(trainer: TorchTrainer, s: TrainSample) -> float:
    lp = teacher_forced(trainer.model, s.tokens)
    return sum(x for x, m in zip(lp, s.mask, strict=True) if m)


def exact_sampling(trainer: TorchTrainer, samples: list[TrainSample], shift: float = 0.0) -> Batch:
    out = []
    for s in samples:
        lp = teacher_forced(trainer.model, s.tokens)
        samp = [x + shift if m else 0.0 for x, m in zip(lp, s.mask, strict=True)]
        out.append(TrainSample(tokens=s.tokens, mask=s.mask, sampling_logprobs=samp,
                               advantage=s.advantage))
    return Batch(samples=out)


def weights(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_micro_batch_size_does_not_change_the_step(tiny_dir: Path, make_samples) -> None:  # type: ignore[no-untyped-def]
    batch = Batch(samples=make_samples(10, seed=3, max_len=40, noise=0.3))
    results = []
    for micro in (16, 3):
        cfg = TrainerSection(lr=1e-3, micro_batch_size=micro,
                            loss=LossSection(name="ppo", reducer="seq-mean-token-mean"))
        t = TorchTrainer(cfg, tiny_dir)
        m = t.train_step(batch)
        results.append((m, weights(t)))
    (m1, w1), (m2, w2) = results
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    assert max_diff(w1, w2) < 1e-5  # Adam turns float-order noise in tiny grads into ~lr*1e-3
    assert m1["tokens"] == sum(sum(s.mask) for s in batch.samples) and m1["step"] == 1


def test_reinforce_raises_the_logprob_of_the_rewarded_sequence(tiny_dir: Path) -> None:
    prompt = [60, 61, 62, 63]
    good = [*prompt, 70, 42, 71, 72, 73]  # contains the rewarded token 42
    bad = [*prompt, 80, 81, 82, 83, 84]
    seqs = [good, bad, good, bad]
    rewards = [float(42 in s) for s in seqs]
    adv = build_advantage("reinforce", baseline=0.5)(rewards)
    cfg = TrainerSection(lr=2e-2, grad_clip=1.0,
                        loss=LossSection(name="reinforce", reducer="token-mean"))
    t = TorchTrainer(cfg, tiny_dir)
    mask = [0] * len(prompt) + [1] * 5
    samples = [TrainSample(tokens=s, mask=mask, sampling_logprobs=[0.0] * len(s), advantage=a)
               for s, a in zip(seqs, adv, strict=True)]
    before = [completion_logprob(t, samples[0]), completion_logprob(t, samples[1])]
    for _ in range(4):
        t.train_step(exact_sampling(t, samples))
    after = [completion_logprob(t, samples[0]), completion_logprob(t, samples[1])]
    assert after[0] > before[0] + 1.0, (before, after)
    assert after[1] < before[1], (before, after)


def test_old_is_current_and_mismatch_is_measured(tiny_dir: Path, make_samples) -> None:  # type: ignore[no-untyped-def]
    t = TorchTrainer(TrainerSection(lr=1e-4, loss=LossSection(tis_cap=2.0)), tiny_dir)
    samples = make_samples(6, seed=4)
    m = t.train_step(exact_sampling(t, samples))
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac"] == 0.0
    assert m["mismatch_abs_mean"] < 1e-5 and m["tis_capped_frac"] == 0.0
    assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    # the engine "sampled" every token 1 nat less likely than the trainer sees it: exp(1) > 2
    m = t.train_step(exact_sampling(t, samples, shift=-1.0))
    assert m["mismatch_abs_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["mismatch_abs_max"] == pytest.approx(1.0, abs=1e-4)
    assert m["tis_capped_frac"] == 1.0 and m["tis_weight_mean"] == pytest.approx(2.0)
    for key in ("loss", "grad_norm", "entropy", "lr", "tokens", "step_time_s", "staleness_mean"):
        assert key in m or key == "staleness_mean"


def test_kl_to_reference_in_bf16(tiny_dir: Path, make_samples) -> None:  # type: ignore[no-untyped-def]
    cfg = TrainerSection(lr=1e-2, dtype="bfloat16",
                        loss=LossSection(kl_coef=0.1, kl_estimator="k3"))
    t = TorchTrainer(cfg, tiny_dir)
    batch = Batch(samples=make_samples(4, seed=5), policy_version=3)
    m1 = t.train_step(batch)
    m2 = t.train_step(batch)
    assert m1["kl"] == pytest.approx(0.0, abs=1e-6)
    assert m2["kl"] > 1e-6
    assert all(v == v and abs(v) != float("inf") for v in m2.values())
    assert 1.0 <= m1["staleness_mean"] <= 3.0 and m1["staleness_max"] == 3.0


def test_state_dict_for_sync_loads_into_a_fresh_model(tiny_dir: Path, make_samples) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    t = TorchTrainer(TrainerSection(lr=1e-2), tiny_dir)
    t.train_step(Batch(samples=make_samples(4, seed=6)))
    sd = t.state_dict_for_sync()
    assert all(v.device.type == "cpu" and v.is_contiguous() and not v.requires_grad
               for v in sd.values())
    fresh = AutoModelForCausalLM.from_pretrained(tiny_dir)
    fresh.load_state_dict(sd, strict=True)
    assert max_diff(weights(t), {k: v for k, v in fresh.state_dict().items()}) == 0.0
    t.train_step(Batch(samples=make_samples(4, seed=7)))
    assert max_diff(weights(t), sd) > 0  # a copy, not a view of the live weights


def test_save_load_restores_weights_optimizer_and_step(
    tiny_dir: Path, make_samples, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = TrainerSection(lr=1e-2, warmup_steps=3)
    a = TorchTrainer(cfg, tiny_dir)
    a.train_step(Batch(samples=make_samples(4, seed=8)))
    a.save(tmp_path / "ckpt")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert max_diff(weights(a), dict(hf.state_dict())) == 0.0
    assert AutoTokenizer.from_pretrained(tmp_path / "ckpt").decode([104, 105]) == "hi"
    b = TorchTrainer(cfg, tiny_dir)
    b.load(tmp_path / "ckpt")
    assert b.step == 1
    nxt = Batch(samples=make_samples(4, seed=9))
    ma, mb = a.train_step(nxt), b.train_step(nxt)
    assert ma["lr"] == mb["lr"] == pytest.approx(2 / 3 * 1e-2)
    assert max_diff(weights(a), weights(b)) == 0.0
    with pytest.raises(FileNotFoundError, match="not a trainer checkpoint"):
        b.load(tmp_path)


def test_bad_batches_fail_clearly_and_empty_ones_skip(tiny_dir: Path) -> None:
    t = TorchTrainer(TrainerSection(), tiny_dir)
    ok = dict(tokens=[1, 2, 3], mask=[0, 1, 1], sampling_logprobs=[0.0, -1.0, -1.0], advantage=1.0)
    with pytest.raises(ValueError, match=r"sample 0: mask\[0\] is 1"):
        t.train_step(Batch(samples=[TrainSample(**{**ok, "mask": [1, 1, 1]})]))
    with pytest.raises(ValueError, match="sample 1: tokens, mask and sampling_logprobs"):
        t.train_step(Batch(samples=[TrainSample(**ok), TrainSample(**{**ok, "mask": [0, 1]})]))
    with pytest.raises(ValueError, match="outside the model's vocab"):
        t.train_step(Batch(samples=[TrainSample(**{**ok, "tokens": [1, 2, 999]})]))
    m = t.train_step(Batch(samples=[TrainSample(**{**ok, "mask": [0, 0, 0]})]))
    assert m["skipped"] == 1.0 and t.step == 0


def test_token_budget_micro_batches_change_nothing_but_the_packing(tiny_dir) -> None:  # type: ignore[no-untyped-def]
    """A token cap on micro-batches (a few long trajectories must not pad everything) gives
    the same step as fixed-size micro-batches: the reducer's denominators are global."""
    import random

    from rl360.policies.trainer_torch import TorchTrainer
    from rl360.recipe import TrainerSection
    from rl360.types import Batch, TrainSample

    rng = random.Random(0)
    samples = []
    for i in range(12):
        n = rng.choice([20, 25, 30, 200])
        samples.append(TrainSample(tokens=[rng.randrange(1, 250) for _ in range(n)],
                                   mask=[0] * 5 + [1] * (n - 5),
                                   sampling_logprobs=[0.0] * 5 + [-1.0] * (n - 5),
                                   advantage=1.0 if i % 2 else -1.0))
    capped = TorchTrainer(TrainerSection(lr=1e-3, micro_batch_size=8, micro_batch_tokens=256), tiny_dir)
    chunks = list(capped._chunks(samples))
    assert sum(len(c) for c in chunks) == 12
    assert all(len(c) * len(c[0].tokens) <= 256 or len(c) == 1 for c in chunks)
    plain = TorchTrainer(TrainerSection(lr=1e-3, micro_batch_size=8), tiny_dir)
    a = capped.train_step(Batch(samples=samples))
    b = plain.train_step(Batch(samples=samples))
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(b["loss"]))
    for (_, p), (_, q) in zip(capped.model.named_parameters(), plain.model.named_parameters(), strict=True):
        assert (p - q).abs().max().item() <= 1e-5


def test_zero_advantage_samples_skip_compute_but_not_the_denominators(  # type: ignore[no-untyped-def]
    tiny_dir: Path, make_samples, monkeypatch
) -> None:
    """Samples of a group whose attempts all scored the same (advantage 0) are not run through
    forward/backward, yet the step is exactly the whole batch's: they stay in the token-mean's
    global denominator."""
    samples = make_samples(12, seed=5, max_len=40, noise=0.3)
    for s in samples[::3]:
        s.advantage = 0.0
    batch = Batch(samples=samples)
    cfg = TrainerSection(lr=1e-3, micro_batch_size=4, loss=LossSection(name="ppo"))
    skipping = TorchTrainer(cfg, tiny_dir)
    m1 = skipping.train_step(batch)
    full = TorchTrainer(cfg, tiny_dir)
    monkeypatch.setattr(full, "_samples_with_gradient", lambda xs: xs)
    m2 = full.train_step(batch)
    assert m1["zero_adv_skipped"] == 4 and m2["zero_adv_skipped"] == 0
    assert m1["tokens"] == m2["tokens"] == sum(sum(s.mask) for s in samples)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6, abs=1e-9)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    assert max_diff(weights(skipping), weights(full)) < 1e-6
    # with a KL term a zero-advantage sample still has a gradient: nothing is skipped
    kl = TorchTrainer(TrainerSection(lr=1e-3, loss=LossSection(name="ppo", kl_coef=0.1)), tiny_dir)
    assert len(kl._samples_with_gradient(samples)) == len(samples)


def test_entropy_bonus_raises_entropy_and_trains_every_sample(tiny_dir: Path, make_samples) -> None:  # type: ignore[no-untyped-def]
    """With only the bonus acting (every advantage 0), a step makes the policy less certain on
    the same tokens; without it the step changes nothing."""
    samples = make_samples(8, seed=7, max_len=30)
    for s in samples:
        s.advantage = 0.0
    batch = Batch(samples=samples)
    plain = TorchTrainer(TrainerSection(lr=1e-2, loss=LossSection(name="ppo")), tiny_dir)
    before = weights(plain)
    assert plain.train_step(batch)["zero_adv_skipped"] == 8
    assert max_diff(before, weights(plain)) == 0.0
    bonus = TorchTrainer(TrainerSection(lr=1e-2, loss=LossSection(name="ppo", entropy_coef=1.0)),
                         tiny_dir)
    first = bonus.train_step(batch)
    second = bonus.train_step(batch)
    assert first["zero_adv_skipped"] == 0
    assert second["entropy"] > first["entropy"]
    with pytest.raises(ValueError, match="entropy_coef"):
        checked(LossSection, entropy_coef=-0.1)
