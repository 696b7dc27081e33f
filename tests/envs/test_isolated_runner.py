"""The isolated test runner on its own (no sandbox): each test's solution process is fresh and
holds only its two pipes, the zygote the children fork from survives no grading, and a
solution that kills the process it was forked from does not stop the other tests' reports.
Both ways of starting it are checked: through runner_input.BOOT (compiled code, marshal spec:
what CodeEnv does) and as `-c <source> parent` with a JSON spec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl360.envs.sandbox import runner_input
from rl360.envs.sandbox.runner_input import RUNNER, runner_argv, runner_stdin

pytestmark = pytest.mark.timeout(120)
STARTS = ["boot", "source"]


def _run(tmp_path: Path, solution: str, tests: list[str], start: str = "boot") -> list[str]:
    """The report lines (index, verdict, why) of one grading."""
    if start == "boot":
        argv = runner_argv(sys.executable)
        stdin = runner_stdin("n0nce", 5.0, solution, tests, "f")
    else:
        argv = [sys.executable, "-I", "-S", "-c", RUNNER, "parent"]
        stdin = json.dumps({"nonce": "n0nce", "per_test_timeout": 5.0, "solution": solution,
                            "tests": tests, "entry_point": "f", "source": RUNNER}).encode()
    res = subprocess.run(argv, cwd=tmp_path, input=stdin, capture_output=True, timeout=90)
    return [line.split(" ", 1)[1] for line in res.stdout.decode().splitlines()
            if line.startswith("n0nce ")]


def _grade(tmp_path: Path, solution: str, tests: list[str], start: str = "boot") -> list[str]:
    return [line.split(" ", 2)[1] for line in _run(tmp_path, solution, tests, start)]


@pytest.mark.parametrize("start", STARTS)
def test_both_starts_grade_alike(tmp_path, start):
    solution = "def f(x):\n    return {'a': [x, (x, 2.5), {x}, b'\\x00']}\n"
    tests = ["assert f(1) == {'a': [1, (1, 2.5), {1}, b'\\x00']}", "assert f(1) == 2",
             "assert f(float('inf'))['a'][0] == float('inf')", "raise ValueError('boom')"]
    assert _grade(tmp_path, solution, tests, start) == ["1", "0", "1", "0"]
    assert _grade(tmp_path, "def f(:\n", ["assert True"], start) == ["0"]


def test_the_grading_parent_imports_no_heavy_module(tmp_path):
    """Its start-up is on every grading: the solution's process, forked from a fork of the
    parent, shows what the parent had imported (json, re, enum, subprocess, ctypes cost more
    than the interpreter's own start)."""
    solution = ("import sys\nHEAVY = [m for m in ('json', 're', 'enum', 'subprocess', 'ctypes',"
                " 'socket', 'signal', 'importlib.util') if m in sys.modules]\n"
                "def f():\n    return HEAVY\n")
    assert _grade(tmp_path, solution, ["assert f() == [], f()"]) == ["1"]


def test_boot_compiles_the_source_when_the_magic_number_differs(tmp_path, monkeypatch):
    """A sandbox image with another Python gets the source, not bytecode it cannot run."""
    head = runner_input.head()
    n = int.from_bytes(head[:4], "big")
    monkeypatch.setattr(runner_input, "head", lambda: head[:4] + b"\xff" * n + head[4 + n:])
    assert runner_stdin("x", 1.0, "", [], None).startswith(head[:4] + b"\xff" * n)
    assert _grade(tmp_path, "def f(x):\n    return x\n", ["assert f(3) == 3"]) == ["1"]


@pytest.mark.parametrize("start", STARTS)
def test_the_solution_process_never_holds_the_tests(tmp_path, start):
    """The zygote is forked before the spec is read (BOOT reads its own part exactly, with no
    read-ahead), so nothing of the tests is anywhere in the solution's memory."""
    solution = (
        "P1, P2 = b'zq7xk-secret', b'-test-marker'\n"
        "def f():\n"
        "    hits = 0\n"
        "    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:\n"
        "        for line in maps:\n"
        "            span, perms = line.split()[:2]\n"
        "            if 'r' not in perms or '[v' in line:\n"
        "                continue\n"
        "            a, b = (int(x, 16) for x in span.split('-'))\n"
        "            try:\n"
        "                mem.seek(a)\n"
        "                chunk = mem.read(b - a)\n"
        "            except (OSError, ValueError, OverflowError):\n"
        "                continue\n"
        "            i = chunk.find(P1)\n"
        "            while i >= 0:\n"
        "                hits += chunk[i + len(P1):i + len(P1) + len(P2)] == P2\n"
        "                i = chunk.find(P1, i + 1)\n"
        "    return hits\n"
    )
    marker = "zq7xk-secret" + "-test-marker"
    assert _run(tmp_path, solution, [f"assert f() == 0, f()  # {marker}"], start)[0] == "0 1 "


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
