"""Loss-token logprobs through the output head in chunks (rl360/policies/token_logprobs.py):
the values and gradients of log_softmax over the full logits, and a trainer step that is the
same step with or without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl360.policies.token_logprobs import linear_logprobs, plain_head
from rl360.policies.trainer_torch import TorchTrainer
from rl360.recipe import LossSection, TrainerSection
from rl360.types import Batch


def reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
              inv_temp: float) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(hidden @ weight.T * inv_temp, dim=-1)
    return (logp_all.gather(1, targets[:, None]).squeeze(1),
            -(logp_all.exp() * logp_all).sum(dim=-1))


def inputs(n: int = 11, h: int = 6, v: int = 17, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64) * 2
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("rows", [1, 4, 64])  # chunks of one row, a remainder, one chunk
@pytest.mark.parametrize("inv_temp", [1.0, 1 / 0.7])
def test_values_match_log_softmax_over_the_full_logits(rows: int, inv_temp: float) -> None:
    hidden, weight, targets = inputs()
    logp, ent = linear_logprobs(hidden, weight, targets, inv_temp, rows=rows)
    ref_logp, ref_ent = reference(hidden, weight, targets, inv_temp)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("use", ["logp", "entropy", "both"])
def test_gradients_match_autograd_through_the_full_logits(use: str) -> None:
    """The recomputing backward against autograd on log_softmax, for a loss on the logprobs,
    on the entropies (an entropy bonus) or on both, with a temperature and chunks of 4 rows."""
    hidden, weight, targets = inputs(seed=1)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(11, generator=g), torch.randn(11, generator=g)
    grads = []
    for fn in ("ours", "reference"):
        h = hidden.float().clone().requires_grad_(True)
        w = weight.float().clone().requires_grad_(True)
        if fn == "ours":
            logp, ent = linear_logprobs(h, w, targets, 1 / 0.7, rows=4)
        else:
            logp, ent = reference(h, w, targets, 1 / 0.7)
        loss = {"logp": (a * logp).sum(), "entropy": (b * ent).sum(),
                "both": (a * logp).sum() + (b * ent).sum()}[use]
        loss.backward()
        grads.append((h.grad, w.grad))
    (gh, gw), (rh, rw) = grads
    torch.testing.assert_close(gh, rh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-5)


def test_gradcheck_in_float64() -> None:
    hidden, weight, targets = inputs(n=5, h=3, v=7, seed=3)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)

    def f(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # fp32 inside: compare the summed outputs loosely through gradcheck's own tolerances
        logp, ent = linear_logprobs(h, w, targets, 1.3, rows=2)
        return (logp * 0.7 + ent * 0.3).double()

    assert torch.autograd.gradcheck(f, (hidden, weight), eps=1e-3, atol=2e-3, rtol=1e-2)


def test_no_rows_gives_empty_outputs_that_still_backpropagate() -> None:
    h = torch.zeros(0, 4, requires_grad=True)
    w = torch.randn(9, 4, requires_grad=True)
    logp, ent = linear_logprobs(h, w, torch.zeros(0, dtype=torch.long))
    assert logp.shape == ent.shape == (0,)
    logp.sum().backward()
    assert w.grad is not None and float(w.grad.abs().sum()) == 0.0


def test_plain_head_only_for_known_bias_free_heads(tiny_dir: Path) -> None:
    for native in (True, False):  # our Llama modules and transformers' model
        t = TorchTrainer(TrainerSection(native_llama=native), tiny_dir)
        assert plain_head(t.model) is t.model.get_output_embeddings()
    t.model.config.model_type = "gemma2"  # soft-capped logits: the full path
    assert plain_head(t.model) is None


@pytest.mark.parametrize("loss", [
    LossSection(name="ppo"),
    LossSection(name="ppo", entropy_coef=0.05),
    LossSection(name="ppo", kl_coef=0.1, kl_estimator="k3"),
])
def test_a_step_is_the_same_step_with_or_without_it(tiny_dir: Path, make_samples,  # type: ignore[no-untyped-def]
                                                     loss: LossSection) -> None:
    """Two optimizer steps (the second has a reference that differs and a nonzero ratio) at a
    sampling temperature of 0.8: the loss, the gradient norm, the metrics and the weights agree
    between the fused path and the full logits."""
    batch = Batch(samples=make_samples(9, seed=11, max_len=30, noise=0.3))
    runs = []
    for fused in (True, False):
        cfg = TrainerSection(lr=1e-3, micro_batch_size=4, fused_logprobs=fused, loss=loss)
        t = TorchTrainer(cfg, tiny_dir, temperature=0.8)
        assert t.fused_logprobs is fused
        ms = [t.train_step(batch), t.train_step(batch)]
        runs.append((ms, {k: v.detach().clone() for k, v in t.model.state_dict().items()}))
    (m_fused, w_fused), (m_full, w_full) = runs
    for a, b in zip(m_fused, m_full, strict=True):
        for key in ("loss", "grad_norm", "entropy", "logprob_mean", "mismatch_abs_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        if loss.kl_coef:
            assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-7)
    # Adam turns float-order noise in tiny gradients into ~lr * 1e-3 (as micro-batching does)
    assert max(float((w_fused[k] - w_full[k]).abs().max()) for k in w_fused) < 1e-5
