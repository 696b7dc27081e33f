"""The isolated test runner on its own (no sandbox): each test's solution process is fresh and
holds only its two pipes, the zygote the children fork from survives no grading, and a
solution that kills the process it was forked from does not stop the other tests' reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl360.envs.code import RUNNER

pytestmark = pytest.mark.timeout(120)


def _grade(tmp_path: Path, solution: str, tests: list[str]) -> list[str]:
    spec = {"nonce": "n0nce", "per_test_timeout": 5.0, "solution": solution, "tests": tests,
            "entry_point": "f", "source": RUNNER}
    res = subprocess.run([sys.executable, "-I", "-S", "-c", RUNNER, "parent"], cwd=tmp_path,
                         input=json.dumps(spec).encode(), capture_output=True, timeout=90)
    return [line.split(" ", 3)[2] for line in res.stdout.decode().splitlines()
            if line.startswith("n0nce ")]


def test_every_test_gets_a_fresh_process_with_only_its_pipes(tmp_path):
    solution = (
        "import os\n"
        "calls = []\n"
        "def f():\n"
        "    calls.append(1)\n"
        "    fds = sorted(int(x) for x in os.listdir('/proc/self/fd'))\n"
        "    return [len(calls), os.getpid(), len(fds), sorted(os.environ)]\n"
    )
    tests = [f"r = f()\nopen('pid{i}', 'w').write(str(r[1]))\nassert r[0] == 1, r\n"
             "assert r[2] <= 7, r\nassert r[3] == ['HOME', 'LANG', 'PATH', 'TMPDIR'], r"
             for i in range(3)]
    assert _grade(tmp_path, solution, tests) == ["1", "1", "1"]
    pids = {(tmp_path / f"pid{i}").read_text() for i in range(3)}
    assert len(pids) == 3


def test_no_process_outlives_the_grading(tmp_path):
    solution = "import os\ndef f():\n    return os.getppid()\n"
    tests = [f"open('ppid{i}', 'w').write(str(f()))" for i in range(2)]
    assert _grade(tmp_path, solution, tests) == ["1", "1"]
    for i in range(2):  # the process the children came from (the zygote) is gone
        assert not Path(f"/proc/{(tmp_path / f'ppid{i}').read_text()}").exists()


def test_a_solution_killing_its_parent_once_leaves_the_other_tests_graded(tmp_path):
    solution = (
        "import os, signal\n"
        "if not os.path.exists('killed'):\n"
        "    open('killed', 'w').close()\n"
        "    os.kill(os.getppid(), signal.SIGKILL)\n"
        "def f(x):\n"
        "    return x + 1\n"
    )
    tests = ["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 4"]
    assert (tmp_path / "killed").exists() is False
    assert _grade(tmp_path, solution, tests) == ["1", "1", "1"]
    assert os.path.exists(tmp_path / "killed")
