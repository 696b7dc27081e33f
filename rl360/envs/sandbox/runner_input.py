"""How the host starts the isolated test runner (isolated_runner.py) inside a sandbox, cheaply.

Every distinct submission pays one start of its grading parent, so what that start costs is CPU
taken from the rollout. The runner starts through the sandbox's BOOT (boot.py): its
stdin holds the runner compiled by the host, then the spec (nonce, per-test timeout, solution,
tests, entry point) as marshal data. BOOT reads its part with exact-size reads, so the runner
forks its zygote before a byte of the spec is in the process: the zygote and the solution
processes forked from it never hold the nonce or the tests, as with the runner started on its
own. Stdin is a memfd (sandbox exec), readable by the grading parent alone.
"""

from __future__ import annotations

import marshal
from pathlib import Path
from typing import Any

from rl360.envs.sandbox.boot import BOOT, boot_head

RUNNER = (Path(__file__).parent / "isolated_runner.py").read_text()


def head() -> bytes:
    """Part 1 of the runner's stdin, compiled once per process at its first grading (not at
    import: the driver and every env actor import the code env)."""
    return boot_head(RUNNER, "isolated_runner.py")


def runner_argv(python: str = "python3", flags: tuple[str, ...] | list[str] = ("-I", "-S")) -> list[str]:
    """The command that starts a grading parent."""
    return [python, *flags, "-c", BOOT, "parent"]


def runner_stdin(nonce: str, per_test_timeout: float, solution: str, tests: list[str],
                 entry_point: str | None) -> bytes:
    """Its stdin: the runner (compiled and as source), then the spec."""
    spec: dict[str, Any] = {"nonce": nonce, "per_test_timeout": float(per_test_timeout),
                            "solution": solution, "tests": list(tests),
                            "entry_point": entry_point}
    return head() + marshal.dumps(spec)
