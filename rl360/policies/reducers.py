"""Loss reducers: a per-token loss [B, T] and its loss mask -> the scalar this shard adds to
the global loss.

Every reducer divides by denominators of the WHOLE global batch (its loss-masked token count,
its number of sequences), never by a micro-batch's or a rank's own counts. The global loss is
then the plain sum of the shards' values and its gradient the plain sum of their gradients, so
neither changes when the batch is cut into other micro-batches or data-parallel ranks (sum
the ranks' gradients; do not average them).

Uses only tensor methods, so importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor


class Reducer(Protocol):
    def __call__(
        self, loss: Tensor, mask: Tensor, *, global_tokens: int, global_seqs: int
    ) -> Tensor: ...


def global_denominators(masks: Iterable[Sequence[int]]) -> tuple[int, int]:
    """(loss-masked tokens, sequences with at least one loss token) over a global batch.
    The one definition every trainer rank and the trainer group share."""
    tokens = seqs = 0
    for m in masks:
        n = int(sum(m))
        tokens += n
        seqs += n > 0
    return tokens, seqs


def _check(loss: Tensor, mask: Tensor, denominator: int, what: str) -> Tensor:
    if loss.shape != mask.shape or loss.dim() != 2:
        raise ValueError(f"reducer wants loss and mask of one [B, T] shape, got "
                         f"{tuple(loss.shape)} and {tuple(mask.shape)}")
    if denominator <= 0:
        raise ValueError(f"reducer needs a positive global {what} count, got {denominator}")
    return mask.to(loss.dtype)


def token_mean(loss: Tensor, mask: Tensor, *, global_tokens: int, global_seqs: int) -> Tensor:
    """sum of loss over loss-masked tokens / loss-masked tokens of the global batch."""
    m = _check(loss, mask, global_tokens, "token")
    return (loss * m).sum() / global_tokens


def seq_mean_token_mean(
    loss: Tensor, mask: Tensor, *, global_tokens: int, global_seqs: int
) -> Tensor:
    """mean over each sequence's loss tokens, then / sequences of the global batch
    (sequences without loss tokens contribute 0 and are not counted)."""
    m = _check(loss, mask, global_seqs, "sequence")
    per_seq = (loss * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    return per_seq.sum() / global_seqs


def seq_mean_token_sum_norm(
    loss: Tensor, mask: Tensor, *, global_tokens: int, global_seqs: int, norm_length: int
) -> Tensor:
    """sum over each sequence's loss tokens / a constant length, then / global sequences
    (Dr.GRPO: no per-sequence length normalisation)."""
    m = _check(loss, mask, global_seqs, "sequence")
    if norm_length <= 0:
        raise ValueError(f"seq-mean-token-sum-norm needs norm_length > 0, got {norm_length}")
    return (loss * m).sum() / (norm_length * global_seqs)


class _SumNorm:
    def __init__(self, norm_length: int) -> None:
        if norm_length <= 0:
            raise ValueError(f"seq-mean-token-sum-norm needs norm_length > 0, got {norm_length}")
        self.norm_length = norm_length

    def __call__(self, loss: Tensor, mask: Tensor, *, global_tokens: int, global_seqs: int) -> Tensor:
        return seq_mean_token_sum_norm(
            loss, mask, global_tokens=global_tokens, global_seqs=global_seqs,
            norm_length=self.norm_length,
        )


REDUCERS = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def build_reducer(name: str, norm_length: int = 1024) -> Reducer:
    """The reducer called `name`; `norm_length` is the constant divisor of
    seq-mean-token-sum-norm (typically the generation length budget)."""
    if name not in REDUCERS:
        raise ValueError(f"unknown loss reducer {name!r}; known: {sorted(REDUCERS)}")
    if name == "seq-mean-token-sum-norm":
        return _SumNorm(norm_length)
    return REDUCERS[name]  # type: ignore[return-value]
