"""A prefix KV cache for multi-turn sessions, keyed by token ids and evicted LRU by bytes.

When a sequence finishes, the engine stores the K/V of every token it fed (the prompt and all
generated tokens but the last). A later prompt that starts with some of those tokens (the next
turn of the same session: previous prompt + reply + tool turn; or another attempt at the same
task) reuses the longest common prefix and prefills only the rest. Entries hold K/V computed
under one policy version; the engine clears the cache when weights change.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class _Entry:
    tokens: np.ndarray
    kv: torch.Tensor  # [layers, 2, kv_heads, len(tokens), head_dim]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class PrefixCache:
    def __init__(self, budget_bytes: int, min_tokens: int = 8) -> None:
        self.budget = budget_bytes
        self.min_tokens = min_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self.nbytes = 0
        self.stats = {"prefix_hits": 0, "prefix_tokens_reused": 0, "prefix_evictions": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[int, torch.Tensor | None]:
        """(n, kv): the first n prompt tokens' K/V (n <= len(prompt) - 1, so at least one token
        is left to prefill for the next-token logits), or (0, None)."""
        if not self._entries or len(prompt) <= self.min_tokens:
            return 0, None
        p = np.asarray(prompt)
        best, best_key = 0, None
        for key, e in self._entries.items():
            m = min(len(e.tokens), len(p) - 1)
            if m <= best or e.tokens[0] != p[0]:
                continue
            neq = np.flatnonzero(e.tokens[:m] != p[:m])
            n = int(neq[0]) if neq.size else m
            if n > best:
                best, best_key = n, key
        if best_key is None or best < self.min_tokens:
            return 0, None
        self._entries.move_to_end(best_key)
        self.stats["prefix_hits"] += 1
        self.stats["prefix_tokens_reused"] += best
        return best, self._entries[best_key].kv

    def insert(self, tokens: list[int], kv: torch.Tensor) -> None:
        if len(tokens) < self.min_tokens:
            return
        entry = _Entry(np.asarray(tokens), kv)
        if entry.nbytes > self.budget:
            return
        for key, e in list(self._entries.items()):  # an entry the new one extends is dominated
            if len(e.tokens) <= len(entry.tokens) and np.array_equal(e.tokens, entry.tokens[: len(e.tokens)]):
                self._drop(key)
            elif len(e.tokens) > len(entry.tokens) and np.array_equal(e.tokens[: len(entry.tokens)], entry.tokens):
                self._entries.move_to_end(key)  # already covered by a longer one
                return
        self._entries[self._next] = entry
        self._next += 1
        self.nbytes += entry.nbytes
        while self.nbytes > self.budget:
            self._drop(next(iter(self._entries)))
            self.stats["prefix_evictions"] += 1

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
