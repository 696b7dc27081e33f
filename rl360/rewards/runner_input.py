"""How the host starts the isolated test runner (isolated_runner.py) inside a sandbox, cheaply.

Every distinct submission pays one interpreter start for its grading parent, so what that start
costs beyond the bare interpreter is CPU taken from the rollout. Passed as `-c <source>`, the
runner's ~600 lines were compiled on every start (~20 ms here, more than the interpreter's own
~16 ms). Instead the sandbox runs BOOT (a few lines) and reads from stdin, in this order:

1. the bytecode magic number of the host's interpreter, the runner compiled by the host
   (`marshal`), and the runner's source, each as a 4-byte big-endian length and the bytes;
   BOOT runs the compiled code when its interpreter's magic number is the same, else it
   compiles the source (a sandbox image with another Python still works, only slower);
2. the spec (nonce, per-test timeout, solution, tests, entry point) as marshal data.

BOOT reads part 1 with exact-size reads (no read-ahead), so the runner forks its zygote before
a byte of the spec is in the process: the zygote and the solution processes forked from it
never hold the nonce or the tests, as with the runner started on its own. Stdin is a memfd
(sandbox exec), readable by the grading parent alone.
"""

from __future__ import annotations

import functools
import importlib.util
import marshal
from pathlib import Path
from typing import Any

RUNNER = (Path(__file__).parent / "isolated_runner.py").read_text()


@functools.cache
def head() -> bytes:
    """Part 1 of the runner's stdin, compiled once per process at its first grading (not at
    import: the driver and every env actor import the code env)."""
    code = marshal.dumps(compile(RUNNER, "isolated_runner.py", "exec"))
    return b"".join(len(p).to_bytes(4, "big") + p
                    for p in (importlib.util.MAGIC_NUMBER, code, RUNNER.encode()))

# runs inside the sandbox with `python -I -S -c BOOT parent` (stdlib only)
BOOT = """\
import marshal, os, sys
def _rd(n):
    b = b""
    while len(b) < n:
        c = os.read(0, n - len(b))
        if not c:
            raise SystemExit("rl360 runner: its input was cut short")
        b += c
    return b
def _part():
    return _rd(int.from_bytes(_rd(4), "big"))
_m, _c, _s = _part(), _part(), _part().decode()
_x = sys.modules.get("_frozen_importlib_external")
_g = {"__name__": "__main__", "RUNNER_SOURCE": _s}
exec(marshal.loads(_c) if getattr(_x, "MAGIC_NUMBER", None) == _m
     else compile(_s, "isolated_runner.py", "exec"), _g)
"""


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
