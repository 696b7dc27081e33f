"""The verifier of a generated tool task (copied to the task's tests/, run by tests/test.sh as
`python3 -I -S /tests/check.py` from /).

It compares the agent's work dir with /tests/expected.json, values the generator computed from
the pristine inputs. It trusts nothing of the agent's: it never imports or runs the agent's
files, reads them only as data (regular files under the work dir, no symlinks, capped in size),
and writes the reward itself (1 or 0) to /logs/verifier/reward.txt.
"""

import ast
import json
import os
import re
import stat
import sys

WORKDIR = "/app"
CAP = 1 << 16


def read(rel):
    """The bytes of a regular file under WORKDIR, decoded; None when missing or not plain."""
    path = os.path.normpath(os.path.join(WORKDIR, rel))
    if not path.startswith(WORKDIR + "/"):
        return None
    if os.path.realpath(path) != path:  # a symlink anywhere on the way
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > CAP:
            return None
        data = os.read(fd, CAP + 1)
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace")


def exists(rel):
    try:
        os.lstat(os.path.join(WORKDIR, rel))
        return True
    except OSError:
        return False


def check(exp):
    kind = exp["kind"]
    if kind == "moved":
        return not exists(exp["src"]) and read(exp["dest"]) == exp["content"]
    got = read(exp["path"])
    if got is None:
        return False
    if kind == "number":
        m = re.search(r"-?\d+", got)
        return m is not None and int(m.group()) == exp["value"]
    if kind == "text":
        return " ".join(got.split()) == " ".join(str(exp["value"]).split())
    if kind == "lines":
        return [ln.rstrip() for ln in got.splitlines() if ln.strip()] == exp["value"]
    if kind == "json":
        try:
            return json.loads(got) == exp["value"]
        except ValueError:
            return False
    if kind == "python_ast":
        try:
            return ast.dump(ast.parse(got)) == ast.dump(ast.parse(exp["value"]))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return False
    raise SystemExit(f"unknown check kind {kind!r}")


def main():
    with open("/tests/expected.json") as f:
        exp = json.load(f)
    ok = check(exp)
    os.makedirs("/logs/verifier", exist_ok=True)
    with open("/logs/verifier/reward.txt", "w") as f:
        f.write("1\n" if ok else "0\n")
    print("pass" if ok else "fail")


if __name__ == "__main__":
    sys.exit(main())
