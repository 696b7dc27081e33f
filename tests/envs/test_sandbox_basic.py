"""The Sandbox contract on every local backend: exec, files, caps on output, errors."""

from __future__ import annotations

import asyncio
import os

import pytest

from rl360.envs import api
from rl360.envs.code import CodeEnv
from rl360.envs.sandbox import (
    ExecResult,
    SandboxError,
    SandboxFileError,
    SandboxLimits,
    SandboxStartError,
    build_sandbox,
    factory,
    resolve_backend,
    unavailable_reason,
)
from rl360.envs.sandbox.interp import reachable_by_others
from rl360.recipe import EnvSection
from rl360.types import Task

pytestmark = pytest.mark.timeout(60)
HAS_AUTOGROUPS = os.path.exists("/proc/self/autogroup")


async def test_exec_shell_and_argv(backend, make_sandbox):
    sb = make_sandbox(backend)
    res = await sb.exec("echo out; echo err >&2; exit 3")
    assert (res.stdout, res.stderr, res.exit_code, res.timed_out) == ("out\n", "err\n", 3, False)
    assert not res.ok and res.wall_s > 0
    res = await sb.exec(
        ["python3", "-I", "-S", "-c", "import sys; print(sys.argv[1:])", "a b", "c"]
    )
    assert res.ok and res.stdout.strip() == "['a b', 'c']"
    missing = await sb.exec(["no-such-program-xyz"])
    assert missing.exit_code == 127 and "no-such-program-xyz" in missing.stderr


async def test_cwd_env_and_files(backend, make_sandbox):
    sb = make_sandbox(backend)
    await sb.write_file("sub/dir/data.bin", b"\x00\x01binary\xff")
    assert await sb.read_file("sub/dir/data.bin") == b"\x00\x01binary\xff"
    assert await sb.read_file(f"{sb.workdir}/sub/dir/data.bin", max_bytes=3) == b"\x00\x01b"
    await sb.write_file("run.sh", '#!/bin/sh\necho "$GREETING from $(pwd)"\n', mode=0o755)
    res = await sb.exec("./run.sh", env={"GREETING": "hello"})
    assert res.stdout.strip() == f"hello from {sb.workdir}"
    res = await sb.exec("pwd", cwd="sub/dir")
    assert res.stdout.strip() == os.path.join(sb.workdir, "sub/dir")
    with pytest.raises(SandboxFileError):
        await sb.read_file("does/not/exist")
    res = await sb.exec("cat sub/dir/data.bin | wc -c")
    assert res.stdout.strip() == "9"


async def test_output_is_capped_head_and_tail(backend, make_sandbox):
    sb = make_sandbox(backend, output_bytes=1000)
    res = await sb.exec(
        [
            "python3",
            "-I",
            "-S",
            "-c",
            "print('BEGIN' + 'x' * 100000 + 'END'); import sys; sys.stderr.write('e' * 10)",
        ]
    )
    assert res.stdout_truncated and not res.stderr_truncated
    assert res.stdout.startswith("BEGIN") and res.stdout.rstrip().endswith("END")
    assert "bytes dropped" in res.stdout and len(res.stdout) < 1100
    assert res.stderr == "e" * 10


async def test_concurrent_execs_in_one_sandbox(backend, make_sandbox):
    sb = make_sandbox(backend)
    results = await asyncio.gather(
        *[
            sb.exec(["python3", "-I", "-S", "-c", f"import time; time.sleep(0.2); print({i})"])
            for i in range(4)
        ]
    )
    assert [r.stdout.strip() for r in results] == ["0", "1", "2", "3"]


async def test_background_child_does_not_hold_exec(backend, make_sandbox):
    sb = make_sandbox(backend)
    res = await sb.exec("sleep 20 & echo quick", timeout=10)
    assert res.ok and res.stdout == "quick\n" and res.wall_s < 2


async def test_interpreter_is_resolved_binary(backend, make_sandbox):
    sb = make_sandbox(backend)
    res = await sb.exec(
        ["python3", "-I", "-S", "-c", "import sys, os; print(os.path.realpath(sys.executable))"]
    )
    assert res.stdout.strip() == sb.python.executable
    assert "shims" not in res.stdout
    if backend == "bwrap":  # reachable by the unprivileged sandbox uid, never via host root
        assert reachable_by_others(sb.python.executable)
        assert reachable_by_others(sb.python.prefix)


async def test_closed_sandbox_refuses(backend, make_sandbox):
    sb = make_sandbox(backend)
    await sb.exec("true")
    await sb.close()
    await sb.close()  # idempotent
    with pytest.raises(SandboxError):
        await sb.exec("true")


def test_factory_errors():
    with pytest.raises(ValueError, match="unknown sandbox backend 'nope'"):
        build_sandbox("nope")
    with pytest.raises(ValueError, match="must be > 0"):
        SandboxLimits(memory_mb=0)
    if unavailable_reason("bwrap") is None:
        assert resolve_backend("auto") == "bwrap"


def test_auto_never_downgrades_silently(monkeypatch):
    """Without bwrap, "auto" fails with the reason unless env.allow_unsandboxed is set; an
    explicit "process" stays allowed (it is a choice, not a downgrade)."""
    monkeypatch.setitem(factory.AVAILABLE, "bwrap", lambda: "bwrap probe failed (test)")
    with pytest.raises(SandboxStartError, match="allow_unsandboxed"):
        resolve_backend("auto")
    with pytest.raises(SandboxStartError, match="bwrap probe failed"):
        build_sandbox("auto")
    assert resolve_backend("auto", allow_unsandboxed=True) == "process"
    task = Task(id="t", prompt="p", data={"tests": ["pass"]})
    with pytest.raises(api.TaskRefused, match="allow_unsandboxed"):
        api.open_sandbox(CodeEnv(), task, "auto")
    assert api.open_sandbox(CodeEnv(), task, "auto", allow_unsandboxed=True).backend == "process"
    assert api.open_sandbox(CodeEnv(), task, "process").backend == "process"
    assert EnvSection().allow_unsandboxed is False


async def test_bwrap_start_failure_is_clear(bwrap_backend):
    sb = build_sandbox(bwrap_backend, SandboxLimits(), ro_binds=["/no/such/dir/for/rl360"])
    with pytest.raises(SandboxStartError, match="no/such/dir"):
        await sb.start()
    await sb.close()


async def test_bwrap_scratch_dirs_and_workdir(bwrap_backend):
    async with build_sandbox(bwrap_backend, SandboxLimits(), "/app", scratch_dirs=["/logs"]) as sb:
        res = await sb.exec("pwd; mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt")
        assert res.ok and res.stdout.strip() == "/app", res
        assert await sb.read_file("/logs/verifier/reward.txt") == b"1\n"
    with pytest.raises(ValueError, match="cannot be a writable dir"):
        build_sandbox(bwrap_backend, SandboxLimits(), "/usr")


def test_sandbox_from_an_event_loop_in_another_thread(backend):
    """Ray async actors run their event loop off the main thread."""
    import threading

    out: dict[str, object] = {}

    async def use() -> None:
        async with build_sandbox(backend, SandboxLimits()) as sb:
            out["res"] = await sb.exec("echo threaded")
            out["pids"] = await sb.host_pids()

    t = threading.Thread(target=lambda: asyncio.run(use()), name="loop-thread")
    t.start()
    t.join(30)
    res = out["res"]
    assert isinstance(res, ExecResult) and res.stdout == "threaded\n"


def test_stale_cgroups_of_dead_owners_are_swept(tmp_path):
    from rl360.envs.sandbox import cgroups

    for name in ["rl360-bwrap-999999999-aa", f"rl360-bwrap-{os.getpid()}-bb", "other-group"]:
        (tmp_path / name).mkdir()
    cgroups._sweep_stale(str(tmp_path))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["other-group", f"rl360-bwrap-{os.getpid()}-bb"]


def test_explicit_unavailable_backend_is_refused_with_reason(monkeypatch):
    from rl360.envs import api
    from rl360.envs.code import CodeEnv

    monkeypatch.setattr(api, "unavailable_reason", lambda name: "no engine")
    with pytest.raises(
        api.TaskRefused, match=r"'t'.*docker sandbox is unavailable here: no engine"
    ):
        api.open_sandbox(CodeEnv(), Task(id="t", prompt="p", data={"tests": ["pass"]}), "docker")


async def test_sandboxed_code_runs_niced(bwrap_backend, make_sandbox):
    """Model-written code yields the CPU to engines and trainers on the same host."""
    import os

    sb = make_sandbox(bwrap_backend)
    res = await sb.exec(["python3", "-c", "import os; print(os.nice(0))"])
    assert res.exit_code == 0, res.stderr
    assert int(res.stdout.strip()) >= min(19, os.nice(0) + 10)


async def test_sandboxed_code_yields_across_sessions(backend, make_sandbox):
    """Where the kernel shares the CPU between sessions first (autogroups), a sandbox's
    niceness only counts inside its own session's group: the group itself is niced, and an
    exec (a warm one too) stays in it instead of opening a session at full weight."""
    if not HAS_AUTOGROUPS:
        pytest.skip("this kernel has no scheduler autogroups")
    sb = make_sandbox(backend)
    show = "print(open('/proc/self/autogroup').read().split()[-1])"
    for argv in (["python3", "-c", show], ["python3", "-I", "-S", "-c", show]):  # cold, warm
        res = await sb.exec(argv)
        assert res.exit_code == 0, res.stderr
        assert int(res.stdout.strip()) == 10, (argv, res.stdout)
