"""Shared-prompt training: a GRPO group's samples begin with the same prompt, so the trainer
runs that prompt through the model once per micro-batch instead of once per sample.

A group of G attempts at one task shares its first prompt (the system prompt, the tools, the
task), which on the SmolLM2 tool tasks is 210 of a sample's ~350 tokens: a micro-batch of one
group's 8 samples costs 210 + 8 x 140 token-positions instead of 8 x 350, 2.1x fewer. Rows whose
tokens up to `split` are equal share one prefix row; every row's suffix (from `split`: the
prompt's last token, whose hidden state predicts the first generated token, and all that
follows) attends to its prefix's keys and values and, causally, to its own. Gradients reach the
prefix through the keys and values of every row that reads it, so the step is the one the
full rows give (up to float rounding: `tests/policies/test_shared_prefix.py`).

`PrefixLayout.of` builds the layout of a right-padded micro-batch; the model side is
`native_llama.Decoder.forward_shared`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PrefixLayout:
    prefix_ids: Tensor  # [P, Lp] right-padded shared prefixes
    row_prefix: Tensor  # [B] which prefix each row continues
    split: Tensor  # [B] where each row's suffix starts (its prefix's length)
    suffix_ids: Tensor  # [B, Ls] right-padded: row[split:]
    width: int  # the micro-batch's row width L

    @staticmethod
    def of(rows: list[list[int]], masks: list[list[int]], width: int,
           pad_id: int) -> PrefixLayout | None:
        """The layout of rows (token ids) whose loss masks start generated tokens at the first
        1; None when no two rows share a prefix of at least 2 tokens (nothing to save)."""
        splits = []
        for toks, m in zip(rows, masks, strict=True):
            first = m.index(1) if 1 in m else len(toks)
            splits.append(max(first - 1, 0))
        keys: dict[tuple[int, ...], int] = {}
        row_prefix = []
        for toks, s in zip(rows, splits, strict=True):
            row_prefix.append(keys.setdefault(tuple(toks[:s]), len(keys)))
        if len(keys) == len(rows) or max(splits) < 2:
            return None
        plen = max(len(k) for k in keys)
        prefix_ids = torch.full((len(keys), max(plen, 1)), pad_id, dtype=torch.long)
        for k, i in keys.items():
            prefix_ids[i, : len(k)] = torch.tensor(k, dtype=torch.long)
        slen = max(len(t) - s for t, s in zip(rows, splits, strict=True))
        suffix_ids = torch.full((len(rows), slen), pad_id, dtype=torch.long)
        for r, (t, s) in enumerate(zip(rows, splits, strict=True)):
            suffix_ids[r, : len(t) - s] = torch.tensor(t[s:], dtype=torch.long)
        return PrefixLayout(prefix_ids, torch.tensor(row_prefix, dtype=torch.long),
                            torch.tensor(splits, dtype=torch.long), suffix_ids, width)

    @property
    def positions_saved(self) -> int:
        """Token positions the shared forward skips against full rows."""
        return (self.suffix_ids.shape[0] * self.width - self.prefix_ids.numel()
                - self.suffix_ids.numel())

    def to(self, device: torch.device) -> PrefixLayout:
        if device.type == "cpu":
            return self
        return PrefixLayout(self.prefix_ids.to(device), self.row_prefix.to(device),
                            self.split.to(device), self.suffix_ids.to(device), self.width)

    def scatter(self, suffix_hidden: Tensor) -> Tensor:
        """Suffix hidden states [B, Ls, H] placed at their positions in the rows' [B, L, H]
        layout (zeros over the prefixes, which carry no loss)."""
        b, ls, h = suffix_hidden.shape
        idx = self.split[:, None] + torch.arange(ls, device=suffix_hidden.device)[None]
        out = suffix_hidden.new_zeros((b, self.width + ls, h))  # room for the padded tails
        out = out.scatter(1, idx[..., None].expand(b, ls, h), suffix_hidden)
        return out[:, : self.width]
