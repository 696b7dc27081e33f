"""The async bench's environment: real sandboxed grading of whatever text the policy writes.

A freshly initialised policy writes no Python, so CodeEnv would find no code and grade nothing.
This env grades the answer TEXT itself with the same machinery: the solution module is
`def answer(): return <the answer as a string literal>`, and the task's tests (asserts over
`answer()`) run in the sandbox through the isolated runner (a parent process for the tests, a
fresh child per test holding the solution), exactly as CodeEnv grades code. Reward: the
fraction of tests passed. Used as `env.env = "bench.async_env:AnswerTextEnv"`.
"""

from __future__ import annotations

from rl360.envs.code import CodeEnv
from rl360.types import Reward


class AnswerTextEnv(CodeEnv):
    async def grade(self, answer: str | None) -> Reward:
        code = f"def answer():\n    return {answer or ''!r}\n"
        passed, total, notes = await self.run_tests(code)
        frac = passed / total if total else 0.0
        return Reward(value=frac, components={"tests_passed": frac,
                                              "all_pass": float(total > 0 and passed == total)},
                      info={"tests": notes})
