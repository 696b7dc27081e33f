"""Warm Python execs (server.py): `python -I -S -c code` runs in a fork of the exec server's
template instead of a new interpreter. It must behave as the interpreter would, never carry
another exec's data, survive the grading pool's sweeps, and fall back to real interpreters when
sandboxed code kills or stops the template."""

from __future__ import annotations

import secrets

import pytest

pytestmark = pytest.mark.timeout(120)

SHOW = (
    "import sys, os\n"
    "print(sys.argv, os.getcwd(), os.environ.get('XX'), repr(sys.stdin.read()),"
    " sys.flags.isolated, sys.flags.no_site, __name__, os.getpgid(0) == os.getpid())\n"
    "sys.stdout.write('no newline')\n"
    "raise SystemExit(3)"
)
# scans this process's own memory for a needle given as two halves in hex: the whole needle is
# never built here, so only a copy that came from elsewhere can match
SCAN = """\
import sys
head, tail = bytes.fromhex(sys.argv[1]), bytes.fromhex(sys.argv[2])


def holds(chunk):
    i = chunk.find(head)
    while i >= 0:
        if chunk[i + len(head):i + len(head) + len(tail)] == tail:
            return True
        i = chunk.find(head, i + 1)
    return False


found = 0
with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
    for line in maps:
        addr, perms = line.split()[:2]
        if not perms.startswith('r') or '[vsyscall]' in line:
            continue
        lo, hi = (int(x, 16) for x in addr.split('-'))
        try:
            mem.seek(lo)
            found += holds(mem.read(hi - lo))
        except (OSError, ValueError, OverflowError):
            pass
print('found' if found else 'clean')
"""
KILL_ALL = (
    "import os\n"
    "for p in os.listdir('/proc'):\n"
    "    if p.isdigit() and int(p) != os.getpid():\n"
    "        try:\n"
    "            os.kill(int(p), 9)\n"
    "        except OSError:\n"
    "            pass\n"
)
STOP_ALL = KILL_ALL.replace("os.kill(int(p), 9)", "os.kill(int(p), 19)")


def py(code: str, *args: str, flags: tuple[str, ...] = ("-I", "-S")) -> list[str]:
    return ["python3", *flags, "-c", code, *args]


async def test_a_warm_exec_behaves_like_an_interpreter(backend, make_sandbox):
    sb = make_sandbox(backend)
    warm = await sb.exec(py(SHOW, "a1", "a2"), env={"XX": "yy"}, stdin=b"hello")
    # the same flags in another order: not eligible, a real interpreter runs it
    cold = await sb.exec(py(SHOW, "a1", "a2", flags=("-S", "-I")), env={"XX": "yy"},
                         stdin=b"hello")
    assert warm.warm and not cold.warm
    assert (warm.stdout, warm.exit_code) == (cold.stdout, cold.exit_code)
    assert warm.exit_code == 3 and warm.stdout.endswith("no newline")
    assert "['-c', 'a1', 'a2']" in warm.stdout and "'hello' 1 1 __main__ True" in warm.stdout
    crash = await sb.exec(py("1/0"))
    assert crash.warm and crash.exit_code == 1
    assert crash.stderr.splitlines()[1:] == ['  File "<string>", line 1, in <module>',
                                            "ZeroDivisionError: division by zero"]
    slow = await sb.exec(py("import time\ntime.sleep(30)"), timeout=0.5)
    assert slow.warm and slow.timed_out and slow.exit_code == -9


async def test_a_warm_exec_holds_no_data_of_earlier_execs(bwrap_backend, make_sandbox):
    sb = make_sandbox(bwrap_backend)
    for _ in range(2):
        secret = b"rl360-secret-" + secrets.token_hex(16).encode()
        first = await sb.exec(py("import sys\nsys.stdin.read()"), stdin=secret)
        assert first.warm and first.ok
        await sb.write_file("/tmp/f", secret)
        await sb.sweep(["/tmp"])
        halves = (secret[:20].hex(), secret[20:].hex())
        scan = await sb.exec(py(SCAN, *halves))
        assert scan.warm and scan.stdout.strip() == "clean", scan
        # the scan does find what is in its own memory
        control = await sb.exec(py(f"x = {secret!r}\n" + SCAN, *halves))
        assert control.stdout.strip() == "found"


async def test_the_sweep_spares_the_template_and_attacks_fall_back(bwrap_backend, make_sandbox):
    sb = make_sandbox(bwrap_backend)
    assert (await sb.exec(py("print(1)"))).warm
    assert await sb.sweep(["/tmp"]) == 0  # the template is no stray
    assert (await sb.exec(py("print(2)"))).warm
    # a solution that stops every process it sees: the sweep finds the stopped template,
    # drops it, and later execs start interpreters and still answer right
    assert (await sb.exec(py(STOP_ALL))).warm
    await sb.sweep(["/tmp"])
    after_stop = await sb.exec(py("print(3)"))
    assert after_stop.stdout == "3\n" and not after_stop.warm


async def test_a_killed_template_falls_back_to_interpreters(backend, make_sandbox):
    sb = make_sandbox(backend)
    if backend == "process":  # its processes are the host's: kill the template alone
        await sb.start()
        pid = sb.ready_info["template"]
        code = f"import os\nos.kill({pid}, 9)"
    else:
        code = KILL_ALL
    assert (await sb.exec(py(code))).warm
    res = await sb.exec(py("print('after')"))
    assert res.stdout == "after\n" and not res.warm


async def test_the_sweep_empties_dirs_without_following_symlinks(bwrap_backend, make_sandbox):
    """The server's own fd-based removal (no shutil): nested dirs go, a symlink goes as a link,
    and what it points to stays."""
    sb = make_sandbox(bwrap_backend)
    setup = (
        "mkdir -p keep/sub /tmp/a/b/c && echo x > keep/sub/f && echo y > /tmp/a/b/c/f && "
        "ln -s \"$PWD/keep\" /tmp/dirlink && ln -s \"$PWD/keep/sub/f\" /tmp/a/filelink && "
        "mkfifo /tmp/fifo"
    )
    assert (await sb.exec(setup)).ok
    assert await sb.sweep(["/tmp"]) == 0
    left = await sb.exec("ls -A /tmp; cat keep/sub/f")
    assert left.stdout == "x\n", left
