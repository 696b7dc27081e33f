"""Fixtures for the search tests: the stdlib-docs corpus and its index, built once per session
by the real commands (`rl360 index stdlib-corpus`, `rl360 index build`) in a subprocess (the
corpus generator imports every stdlib module; the test process stays clean)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def rl360(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rl360", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="session")
def stdlib_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stdlib-search")
    out = rl360("index", "stdlib-corpus", str(root / "corpus.jsonl"))
    assert out.returncode == 0, out.stderr
    out = rl360("index", "build", str(root / "corpus.jsonl"), "--out", str(root / "index"))
    assert out.returncode == 0, out.stderr
    return root / "index"
