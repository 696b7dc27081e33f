"""Token sampling for the torch engine, one call per decode step for all rows.

The logprob returned with each token is its log-probability under the distribution it was
sampled from: for temperature > 0 after temperature, then top-k, then top-p (the token that
crosses p is kept), as vLLM's `processed_logprobs`; for greedy (temperature 0) the raw
distribution. Each row draws its uniform from its own `random.Random` (seeded per request), so
a seed fixes a row's tokens whatever else runs in the batch; the draw itself is one inverse-CDF
lookup for all rows. (It was one `torch.multinomial` per row with a per-row torch.Generator:
~80 us of op dispatch a row, 20 ms a decode step at 256 rows on the demo's box, where a draw
from `random.Random` is ~0.1 us.)
"""

from __future__ import annotations

import random

import torch

from rl360.types import SamplingParams

_NEG_INF = float("-inf")


def processed_logprobs_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[rows, vocab] logprobs of each row's sampling distribution (every temperature > 0)."""
    vocab = logits.shape[-1]
    temps = torch.tensor([sp.temperature for sp in params], dtype=logits.dtype)
    scaled = logits / temps[:, None]
    ks = [sp.top_k if sp.top_k and 0 < sp.top_k < vocab else 0 for sp in params]
    if any(ks):
        top = torch.topk(scaled, max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks])[:, None])
        kth = kth.masked_fill(torch.tensor([k == 0 for k in ks])[:, None], _NEG_INF)
        scaled = scaled.masked_fill(scaled < kth, _NEG_INF)
    ps = [sp.top_p for sp in params]
    if any(p < 1.0 for p in ps):
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= torch.tensor(ps, dtype=probs.dtype)[:, None]
        drop &= torch.tensor([p < 1.0 for p in ps])[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
        scaled = torch.full_like(scaled, _NEG_INF).scatter(1, order, sorted_logits)
    return torch.log_softmax(scaled, dim=-1)


def processed_logprobs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """One row's (a [vocab] tensor) sampling logprobs; what the parity tests compare against."""
    return processed_logprobs_rows(logits[None], [sp])[0]


def draw(probs: torch.Tensor, uniforms: list[float]) -> list[int]:
    """Inverse-CDF sampling, one row each: the smallest token whose cumulative probability
    exceeds u x the row's total (so a float32 cumsum that ends below 1 never runs past the
    last token, and a token of probability 0 is never drawn)."""
    cdf = probs.cumsum(-1)
    if not bool(torch.isfinite(cdf[:, -1]).all()):  # as torch.multinomial refuses them
        raise ValueError("sampling: the model gave non-finite probabilities (NaN or inf logits)")
    u = torch.tensor(uniforms, dtype=cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=probs.shape[-1] - 1).tolist()


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[random.Random | None]) -> list[tuple[int, float]]:
    """(token, logprob) per row of float32 `logits` [rows, vocab]; a row without its own
    generator draws from the `random` module's."""
    out: list[tuple[int, float]] = [(0, 0.0)] * len(params)
    greedy = [i for i, sp in enumerate(params) if sp.temperature <= 0.0]
    sampled = [i for i, sp in enumerate(params) if sp.temperature > 0.0]
    if greedy:
        rows = logits[greedy] if len(greedy) < len(params) else logits
        logp = torch.log_softmax(rows, dim=-1)
        toks = torch.argmax(rows, dim=-1)
        lps = logp.gather(1, toks[:, None])[:, 0].tolist()
        for j, (i, t) in enumerate(zip(greedy, toks.tolist(), strict=True)):
            out[i] = (t, lps[j])
    if sampled:
        rows = logits[sampled] if len(sampled) < len(params) else logits
        logp = processed_logprobs_rows(rows, [params[i] for i in sampled])
        probs = logp.exp()
        toks = draw(probs, [(generators[i] or random).random() for i in sampled])
        lps = logp.gather(1, torch.tensor(toks)[:, None])[:, 0].tolist()
        for j, i in enumerate(sampled):
            out[i] = (toks[j], lps[j])
    return out
