"""SyntheticEnv: an env whose episodes take a configurable, long-tailed time and whose reward
does not depend on the model. It measures the framework (async overlap, stragglers, load),
not the policy: real agent tasks have a long tail of slow episodes, and this reproduces it
without sandbox CPU work. Registered as "synthetic"."""

from __future__ import annotations

import asyncio
import random

from rl360.envs.api import Env, EnvStart
from rl360.envs.sandbox import Sandbox
from rl360.types import Message, Reward, Task


class SyntheticEnv(Env):
    reuse_sandbox = True  # it never touches the sandbox

    def __init__(
        self, median_s: float = 0.3, sigma: float = 1.0, max_s: float = 10.0, p_success: float = 0.5
    ) -> None:
        self.median_s, self.sigma, self.max_s, self.p = median_s, sigma, max_s, p_success
        self.rng = random.Random()

    async def setup(self, task: Task, sandbox: Sandbox) -> EnvStart:
        seed = task.data.get("seed")
        if seed is not None:
            self.rng.seed(f"{seed}-{id(self)}")
        return EnvStart(messages=[Message(role="user", content=task.prompt)])

    async def verify(self) -> Reward:
        delay = min(self.max_s, self.median_s * self.rng.lognormvariate(0.0, self.sigma))
        await asyncio.sleep(delay)  # the slow part of an agent episode (tools, tests)
        ok = self.rng.random() < self.p
        return Reward(float(ok), {"all_pass": float(ok)}, {"delay_s": delay})
