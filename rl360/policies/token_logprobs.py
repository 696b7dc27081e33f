"""Per-token logprobs and entropies from hidden states, without the [tokens, vocab] logits.

The trainer needs one number per loss token (the target's logprob, and the entropy for the
metric or an entropy bonus), yet a causal LM's head computes logits for every position of
every row: [rows, width, vocab] in fp32, then copies of it (slice, cast, temperature) and
passes over it (logsumexp, gather, softmax for the entropy). Prompt and padding positions,
most of a batch's positions, need none of it. Here the decoder's hidden states are taken at
the loss positions only and the head runs over them in chunks of rows: each chunk's logits
live in cache (CPU) or in a bounded buffer (GPU) and are dropped; backward recomputes them
per chunk (one extra head matmul) instead of keeping every chunk's softmax, the scheme of
fused linear-cross-entropy kernels. The numbers are those of log_softmax(h W^T / T)
(`tests/policies/test_token_logprobs.py` checks values and gradients against it).

    logp, ent = linear_logprobs(hidden [N, H], weight [V, H], targets [N], inv_temp)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# logits elements per chunk: 8 MB of fp32 on a CPU (a share of the last-level cache), 256 MB
# on an accelerator (big enough to keep the matmuls efficient)
_CHUNK_ELEMENTS = {"cpu": 1 << 21}
_CHUNK_ELEMENTS_ACCEL = 1 << 26

# HF model types whose output head is a bias-free Linear over the decoder's last hidden state,
# with no logit scaling or soft-capping after it (Gemma's, Cohere's heads do more)
PLAIN_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def chunk_rows(vocab: int, device: torch.device) -> int:
    elements = _CHUNK_ELEMENTS.get(device.type, _CHUNK_ELEMENTS_ACCEL)
    return max(1, elements // max(1, vocab))


def plain_head(model: Any) -> Any:
    """The model's output head when logits are exactly `head(decoder(x).last_hidden_state)` with
    a bias-free Linear head (then `linear_logprobs` can replace the logits), else None."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if kind not in PLAIN_HEAD_TYPES or not isinstance(head, torch.nn.Linear):
        return None
    if head.bias is not None or not hasattr(model, "get_decoder"):
        return None
    return head


class _LinearLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (logprob [N], entropy [N]) of
    softmax(hidden @ weight.T * inv_temp), computed in fp32, chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: float,
                rows: int) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        w = weight.float()
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for a in range(0, n, rows):
            b = min(n, a + rows)
            z = hidden[a:b].float() @ w.T
            if inv_temp != 1.0:
                z.mul_(inv_temp)
            lse[a:b] = torch.logsumexp(z, dim=-1)
            z.sub_(lse[a:b, None])  # z is now log p
            logp[a:b] = z.gather(1, targets[a:b, None]).squeeze(1)
            ent[a:b] = -(z.exp() * z).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.inv_temp, ctx.rows = inv_temp, rows
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None,
                 g_ent: Tensor | None) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        inv_temp, rows = ctx.inv_temp, ctx.rows
        w = weight.float()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(w) if need_w else None
        for a in range(0, hidden.shape[0], rows):
            b = min(hidden.shape[0], a + rows)
            h = hidden[a:b].float()
            logp = h @ w.T
            if inv_temp != 1.0:
                logp.mul_(inv_temp)
            logp.sub_(lse[a:b, None])
            p = logp.exp()
            # d logp_t / dz = onehot(t) - p;  d H / dz = -p (log p + H)
            if g_ent is not None:
                g = logp.add_(ent[a:b, None]).mul_(p).mul_(-g_ent[a:b, None])
                if g_logp is not None:
                    g.sub_(p.mul_(g_logp[a:b, None]))
            else:
                g = p.mul_(-g_logp[a:b, None])  # type: ignore[index]
            if g_logp is not None:
                g.scatter_add_(1, targets[a:b, None], g_logp[a:b, None])
            if inv_temp != 1.0:
                g.mul_(inv_temp)
            if grad_h is not None:
                grad_h[a:b] = (g @ w).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(g.T, h)
        return (grad_h, grad_w.to(weight.dtype) if grad_w is not None else None,
                None, None, None)


def linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: float = 1.0,
                    rows: int | None = None) -> tuple[Tensor, Tensor]:
    """log softmax(hidden @ weight.T * inv_temp)[targets] and the softmax's entropy, per row of
    `hidden` ([N, H]; `weight` [V, H], `targets` [N] long), both fp32 and differentiable.
    `rows`: rows per chunk (default: by vocabulary size and device)."""
    if hidden.shape[0] == 0:
        z = hidden.new_zeros(0, dtype=torch.float32)
        return z + (hidden.sum() + weight.sum()) * 0.0, z.clone()
    rows = rows or chunk_rows(weight.shape[0], hidden.device)
    logp, ent = _LinearLogprobs.apply(hidden, weight, targets, float(inv_temp), int(rows))
    return logp, ent
