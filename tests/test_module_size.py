"""No module of rl360 passes 500 lines: a module that outgrows that splits along its seams
(ARCHITECTURE.md). The two stdlib-only scripts that run inside a sandbox are exempt by name:
each is started as one file through BOOT (rl360/envs/sandbox/boot.py) and imports nothing of
rl360, so it cannot be split into modules."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 500
EXEMPT = {"rl360/envs/sandbox/server.py", "rl360/envs/sandbox/isolated_runner.py"}


def sizes() -> dict[str, int]:
    return {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
            for p in (ROOT / "rl360").rglob("*.py")}


def test_no_module_passes_500_lines() -> None:
    over = {path: n for path, n in sizes().items() if n > LIMIT and path not in EXEMPT}
    assert over == {}


def test_the_exempt_scripts_are_still_there() -> None:
    assert EXEMPT <= set(sizes())
