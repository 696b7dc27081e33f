"""Shared-prompt training: running each shared prefix once gives the hidden states, logprobs
and gradients of the full rows (float rounding apart)."""

from __future__ import annotations

import random

import pytest
import torch

from rl360.policies.native_llama import load_native_llama, native_config
from rl360.policies.shared_prefix import PrefixLayout


@pytest.fixture(scope="module")
def model(tiny_dir):  # type: ignore[no-untyped-def]
    cfg = native_config(tiny_dir)
    assert cfg is not None
    torch.manual_seed(0)
    m = load_native_llama(tiny_dir, cfg, torch.float32, torch.device("cpu"))
    return m.train()


def _rows(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Two groups of three attempts (a shared prompt, then replies of their own length) and
    one row alone; the loss mask starts at each reply."""
    rng = random.Random(seed)
    rows, masks = [], []
    for plen, n in ((9, 3), (5, 3), (7, 1)):
        prompt = [rng.randrange(3, vocab) for _ in range(plen)]
        for _ in range(n):
            reply = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 8))]
            rows.append(prompt + reply)
            masks.append([0] * plen + [1] * len(reply))
    return rows, masks


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for r, t in enumerate(rows):
        ids[r, : len(t)] = torch.tensor(t)
    return ids


def test_layout_groups_rows_by_prompt_and_splits_before_the_first_reply_token() -> None:
    rows, masks = _rows(50)
    lay = PrefixLayout.of(rows, masks, max(map(len, rows)), pad_id=0)
    assert lay is not None
    assert lay.row_prefix.tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert lay.split.tolist() == [8, 8, 8, 4, 4, 4, 6]  # the prompt's last token is suffix
    assert lay.positions_saved > 0
    alone = PrefixLayout.of(rows[-1:], masks[-1:], len(rows[-1]), pad_id=0)
    assert alone is None  # nothing shared, nothing to save


def test_shared_forward_matches_full_rows_in_values_and_gradients(model) -> None:  # type: ignore[no-untyped-def]
    rows, masks = _rows(model.config.vocab_size)
    ids = _padded(rows, 0)
    sel = torch.zeros(ids.shape, dtype=torch.bool)
    for r, m in enumerate(masks):
        sel[r, : len(m) - 1] = torch.tensor(m[1:], dtype=torch.bool)  # hidden t -> target t+1
    decoder, head = model.get_decoder(), model.get_output_embeddings()

    def loss_and_grads(hidden: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits = head(hidden[sel])
        targets = ids[:, 1:][sel[:, :-1]]
        logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
        loss = -(logp * torch.linspace(0.5, 1.5, len(logp))).sum()
        model.zero_grad(set_to_none=True)
        loss.backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    full = decoder(ids).last_hidden_state
    lay = PrefixLayout.of(rows, masks, ids.shape[1], pad_id=0)
    assert lay is not None
    shared = decoder.forward_shared(lay)
    assert torch.allclose(shared[sel], full[sel], atol=1e-5)
    lp_full, g_full = loss_and_grads(decoder(ids).last_hidden_state)
    lp_shared, g_shared = loss_and_grads(decoder.forward_shared(lay))
    assert torch.allclose(lp_full, lp_shared, atol=1e-5)
    assert len(g_full) == len(g_shared)
    for a, b in zip(g_full, g_shared, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def _group_batch(vocab: int, seed: int = 5):  # type: ignore[no-untyped-def]
    """Three GRPO groups of four attempts: a shared prompt per group, replies with a masked
    tool-output hole, advantages of both signs."""
    from rl360.types import Batch, TrainSample

    rng = random.Random(seed)
    samples = []
    for plen in (12, 7, 15):
        prompt = [rng.randrange(3, vocab) for _ in range(plen)]
        for _ in range(4):
            reply = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))]
            mask = [0] * plen + [1] * len(reply)
            mask[plen + 2] = 0
            samples.append(TrainSample(
                tokens=prompt + reply, mask=mask,
                sampling_logprobs=[-5.5 + rng.gauss(0, 0.2) if m else 0.0 for m in mask],
                advantage=rng.gauss(0.0, 1.0)))
    return Batch(samples=samples)


@pytest.mark.parametrize("lora", [False, True])
def test_a_train_step_is_the_same_with_shared_prompts(tiny_dir, lora: bool) -> None:  # type: ignore[no-untyped-def]
    """Two optimizer steps with and without shared prompts (full fine-tuning and LoRA): the
    same loss, gradient norm, metrics and weights, and the shared run really shared."""
    from rl360.policies.trainer_torch import TorchTrainer
    from rl360.recipe import LoraSection, LossSection, TrainerSection

    batch = _group_batch(256)
    runs = []
    for shared in (True, False):
        cfg = TrainerSection(lr=1e-3, micro_batch_size=4, shared_prefix=shared,
                             loss=LossSection(name="ppo"),
                             lora=LoraSection(rank=4, alpha=8.0) if lora else None)
        t = TorchTrainer(cfg, tiny_dir, temperature=0.8)
        assert t.shared_prefix is shared
        if shared:
            mbs = list(t._micro_batches(batch.samples))
            assert all(mb.prefix is not None for mb in mbs)  # one group per micro-batch
            assert [len(mb.rows) for mb in mbs] == [4, 4, 4]
        ms = [t.train_step(batch), t.train_step(batch)]
        runs.append((ms, {k: v.detach().clone() for k, v in t.model.state_dict().items()}))
    (m_sh, w_sh), (m_full, w_full) = runs
    for a, b in zip(m_sh, m_full, strict=True):
        for key in ("loss", "grad_norm", "entropy", "logprob_mean", "mismatch_abs_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # Adam divides by sqrt(v): float-order noise in a near-zero gradient moves that weight by a
    # part of lr per step, here 2 steps at 1e-3 (the gradients themselves agree to 1e-5 above)
    assert max(float((w_sh[k] - w_full[k]).abs().max()) for k in w_sh) < 5e-5
