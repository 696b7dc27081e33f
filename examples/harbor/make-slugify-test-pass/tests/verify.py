"""The verifier of make-slugify-test-pass (run by test.sh as `python3 -I /tests/verify.py`).

It never imports the agent's /app/textutil.py: `slugify` runs in a child process of its own,
which gets the texts as JSON on stdin and answers with JSON strings; this process compares them
with the slugs it knows, kills every process the child left (it is their subreaper) and only
then writes the reward (the fraction of cases right). It is non-dumpable: the child cannot
trace it or read its memory.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys

CASES = [("Hello World", "hello-world"), ("  RL360: fast & async!  ", "rl360-fast-async"),
         ("a--b__c", "a-b-c"), ("---", ""), ("Already-slug-42", "already-slug-42")]
CHILD = """
import json, sys
texts = json.loads(sys.stdin.read())
sys.path.insert(0, "/app")
from textutil import slugify
out = []
for text in texts:
    try:
        out.append(slugify(text))
    except Exception:
        out.append(None)
sys.stdout.write(json.dumps(out))
"""
REWARD = "/logs/verifier/reward.json"


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
        out = subprocess.run([sys.executable, "-I", "-c", CHILD],
                             input=json.dumps([text for text, _ in CASES]),
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
    passed = 0
    if clean and got is not None and len(got) == len(CASES):
        passed = sum(type(g) is str and g == want for g, (_, want) in zip(got, CASES, strict=True))
    for name in ("reward.txt", "reward.json"):
        try:
            os.unlink(f"/logs/verifier/{name}")
        except FileNotFoundError:
            pass
    fd = os.open(REWARD, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    reward = {"reward": passed / len(CASES), "passed": passed, "total": len(CASES)}
    os.write(fd, json.dumps(reward).encode())
    os.close(fd)


main()
