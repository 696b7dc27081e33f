"""The verifier of fix-mean-bug (run by test.sh as `python3 -I /tests/verify.py`).

It never imports the agent's /app/stats.py: `mean` runs in a child process of its own, which
gets the cases as JSON on stdin and answers with JSON numbers; this process compares them with
values it computes itself, kills every process the child left (it is their subreaper) and only
then writes the reward. It is non-dumpable: the child cannot trace it or read its memory.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys

CASES = [[1, 2, 3], [5], [1.5, 2.5], [-4, 4, 9], [1000000, 2], [7, 7, 7, 7]]
CHILD = """
import json, sys
cases = json.loads(sys.stdin.read())
sys.path.insert(0, "/app")
from stats import mean
out = []
for xs in cases:
    try:
        out.append(mean(xs))
    except Exception:
        out.append(None)
sys.stdout.write(json.dumps(out))
"""
REWARD = "/logs/verifier/reward.txt"


def prctl(option, value):
    ctypes.CDLL(None).prctl(option, value, 0, 0, 0)


def kill_descendants():
    """Kill every process this one adopted or started, until none is left (bounded)."""
    me = os.getpid()
    for _ in range(1000):
        kids = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                            kids.append(int(name))
                except (OSError, ValueError, IndexError):
                    continue
        if not kids:
            return True
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in kids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    return False


def answers():
    try:
        out = subprocess.run([sys.executable, "-I", "-c", CHILD], input=json.dumps(CASES),
                             capture_output=True, text=True, timeout=20, cwd="/app").stdout
        got = json.loads(out)
    except (subprocess.TimeoutExpired, ValueError):
        return None
    return got if type(got) is list else None


def main():
    prctl(4, 0)  # PR_SET_DUMPABLE 0
    prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the child's orphans become ours
    got = answers()
    clean = kill_descendants()
    want = [sum(xs) / len(xs) for xs in CASES]
    ok = clean and got is not None and len(got) == len(want) and all(
        type(g) in (int, float) and abs(g - w) < 1e-9 for g, w in zip(got, want, strict=True))
    for name in ("reward.txt", "reward.json"):
        try:
            os.unlink(f"/logs/verifier/{name}")
        except FileNotFoundError:
            pass
    fd = os.open(REWARD, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    os.write(fd, b"1" if ok else b"0")
    os.close(fd)


main()
