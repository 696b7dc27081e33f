"""Fixtures for the merge tests (helpers live in merge_helpers.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from merge_helpers import TAUS, write_checkpoint


@pytest.fixture
def ckpt(tmp_path: Path) -> Callable[..., Path]:
    def make(name: str, tensors: dict[str, torch.Tensor], shards: int = 1, **kw) -> Path:
        return write_checkpoint(tmp_path / name, tensors, shards, **kw)

    return make


@pytest.fixture
def spec_model(ckpt: Callable[..., Path]) -> tuple[Path, list[Path], torch.Tensor]:
    """The spec's shared vectors as one tensor "w" (fp32) on a nonzero base."""
    base = torch.tensor([0.5, -0.25, 1.0, 0.125, 0.25, -0.75])
    experts = [ckpt(f"e{i}", {"w": base + torch.tensor(t)}) for i, t in enumerate(TAUS)]
    return ckpt("base", {"w": base}), experts, base


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Merges are checked for values and bytes, not speed; on a shared 2-core machine a second
    OpenMP thread mostly spins. Restored after each test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
