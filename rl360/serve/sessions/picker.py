"""Sample pickers: which leaves of a session's token forest become training samples.

`all` (default) trains every leaf: retries, branches, `n > 1` choices and sub-conversations
each count. `longest` keeps the one leaf with the most tokens, `last` the latest leaf (the
agent's final line). A picker returns a subset of the leaves, without duplicates, in node
order (TITO invariant 12); ties go to the latest leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Forest(Protocol):
    def leaves(self) -> list[int]: ...

    def path_tokens(self, nid: int) -> list[int]: ...


def _all(forest: Forest, leaves: list[int]) -> list[int]:
    return leaves


def _longest(forest: Forest, leaves: list[int]) -> list[int]:
    return [max(leaves, key=lambda n: (len(forest.path_tokens(n)), n))] if leaves else []


def _last(forest: Forest, leaves: list[int]) -> list[int]:
    return [max(leaves)] if leaves else []


PICKERS: dict[str, Callable[[Forest, list[int]], list[int]]] = {
    "all": _all,
    "longest": _longest,
    "last": _last,
}


def pick(forest: Forest, picker: str) -> list[int]:
    fn = PICKERS.get(picker)
    if fn is None:
        raise ValueError(f"unknown sample picker {picker!r}; known: {sorted(PICKERS)}")
    return sorted(set(fn(forest, sorted(forest.leaves()))))


def picker_names() -> list[str]:
    return sorted(PICKERS)

