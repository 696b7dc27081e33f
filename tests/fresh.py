"""Run code in a fresh interpreter (what a new process imports is only visible there)."""

from __future__ import annotations

import subprocess
import sys


def last_line(code: str, timeout_s: float = 120) -> str:
    """The last line `code` prints in a fresh interpreter; fails the test if it fails."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout_s)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]
