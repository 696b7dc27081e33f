"""Fixtures for the trainer tests: sample/batch factories and one torch thread per test."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator

import pytest

from rl360.types import TrainSample


@pytest.fixture(scope="session", autouse=True)
def _own_ray_cluster() -> None:
    """Make the session's `ray_cluster` start its own local Ray instead of joining whatever
    cluster another process on this machine left in /tmp/ray/ray_current_cluster (session
    autouse fixtures are set up before the ones a test asks for)."""
    os.environ.setdefault("RAY_ADDRESS", "local")


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def random_samples(
    n: int,
    *,
    seed: int = 0,
    min_len: int = 6,
    max_len: int = 24,
    vocab: int = 256,
    prompt: int = 3,
    noise: float = 0.1,
) -> list[TrainSample]:
    """n sequences of random tokens: a prompt, then loss tokens (with a masked hole), plausible
    sampling logprobs near -log(vocab), and advantages around 0."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        p = min(prompt, length - 1)
        mask = [0] * p + [1] * (length - p)
        if length - p > 4:
            mask[p + 2] = 0  # a tool-output token inside the completion
        base = -5.55
        samp = [base + rng.gauss(0.0, noise) if m else 0.0 for m in mask]
        reward = float(rng.random() < 0.5)
        out.append(TrainSample(
            tokens=[rng.randrange(vocab) for _ in range(length)], mask=mask,
            sampling_logprobs=samp, advantage=rng.gauss(0.0, 1.0), reward=reward,
            versions=[-1 if not m else rng.randint(0, 2) for m in mask],
        ))
    return out


@pytest.fixture
def make_samples() -> Callable[..., list[TrainSample]]:
    return random_samples
