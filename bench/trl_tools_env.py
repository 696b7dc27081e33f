"""The rollout side of bench/trl_tools.py: the bash tool, the call parser and the verifier.

`BashEpisode` is what TRL's `environment_factory` builds, one per rollout: `reset` copies a
Harbor task's environment/files/ into a fresh temp dir; `bash`, its one public method and so
TRL's one tool, runs a command with that dir mounted at the task's work dir (/app) in a
bubblewrap sandbox of its own (no network, own pid namespace, read-only system dirs, private
/tmp; CPU seconds and file size capped by rlimits, the wall time by a timeout); `_verify` runs
the task's tests/test.sh the same way, with tests/ at /tests and a fresh /logs, and reads
/logs/verifier/reward.txt. A namespace per command, not RL360's sandbox: no cgroup memory cap,
no warm exec server, no clean room. Arguments are checked and results formatted by RL360's own
tool code (rl360.envs.tools), so the model reads the text RL360's bash tool writes.

`use_rl360_parser` makes the tokenizer parse replies with RL360's parser; `Verifier` is TRL's
reward function (every rollout's `_verify`, on a few threads) and keeps the batch's episode stats.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl360.envs.sandbox import ExecResult
from rl360.envs.tools import check_arguments, clip, format_exec

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
OUTPUT_CAP = 1 << 16  # bytes kept of a command's stdout / stderr (the head), the sandbox's cap
FILE_CAP_MB = 64  # RLIMIT_FSIZE of a command when the task names no storage size
# SmolLM2's call format as a transformers response template: TRL only takes its tool path for a
# tokenizer that has one; the parsing itself is RL360's (see use_rl360_parser)
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*",
                       "content": "json", "transform_each": True,
                       "transform": {"type": "function",
                                     "function": {"name": "{name}", "arguments": "{arguments}"}}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def sandbox_argv(binds: list[tuple[str, str, bool]], cwd: str) -> list[str]:
    """bubblewrap around one command: read-only system dirs, its own namespaces (no network),
    a private /tmp, `binds` as (host path, sandbox path, writable), a clean environment."""
    args = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent",
            "--new-session", "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
            "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    args += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for host, inside, writable in binds:
        args += ["--bind" if writable else "--ro-bind", host, inside]
    return [*args, "--chdir", cwd]


def bwrap_unavailable() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed (apt-get install bubblewrap)"
    with tempfile.TemporaryDirectory() as d:
        try:
            out = subprocess.run([*sandbox_argv([(d, "/app", True)], "/app"), "/bin/true"],
                                 capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap failed to run: {e}"
        if out.returncode != 0:
            return f"bwrap cannot create namespaces here: {out.stderr.decode().strip()}"
    return None


def run_sandboxed(argv: list[str], timeout_s: float, scratch: Path, cpu_s: int, file_mb: int
                  ) -> ExecResult:
    """Run `argv`; stdout and stderr go to files in `scratch` (capped by RLIMIT_FSIZE, the head
    kept), the process group is killed at `timeout_s`."""

    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))

    t0 = time.monotonic()
    out_p, err_p = scratch / "stdout", scratch / "stderr"
    with open(out_p, "wb") as out, open(err_p, "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True, preexec_fn=limits)
        timed_out = False
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()

    def head(p: Path) -> tuple[str, bool]:
        with open(p, "rb") as f:
            data = f.read(OUTPUT_CAP + 1)
        return data[:OUTPUT_CAP].decode(errors="replace"), len(data) > OUTPUT_CAP

    stdout, so_cut = head(out_p)
    stderr, se_cut = head(err_p)
    return ExecResult(stdout, stderr, -9 if timed_out else code, timed_out=timed_out,
                      stdout_truncated=so_cut, stderr_truncated=se_cut,
                      wall_s=time.monotonic() - t0)


@dataclass
class EpisodeLimits:
    exec_timeout_s: float
    cpu_s: int
    max_output_chars: int
    max_tool_output_chars: int
    tool_spec: Any  # rl360 ToolSpec of bash


class BashEpisode:
    """One rollout's environment (TRL's `environment_factory`): `reset` copies the task's
    files into a fresh temp dir, `bash` (the one public method, so TRL's one tool) runs a command
    there, mounted at the task's work dir. `_verify` runs the task's verifier on the result."""

    limits: EpisodeLimits  # set on the class by main() before TRL builds instances

    def __init__(self) -> None:
        self.root: Path | None = None
        self.task_dir: Path | None = None
        self.workdir = "/app"
        self.file_mb = FILE_CAP_MB
        self.tool_calls = 0
        self.tool_failures = 0

    def reset(self, task_dir: str, workdir: str = "/app", storage_mb: int | None = None,
              **_: Any) -> None:
        self._cleanup()
        self.task_dir, self.workdir = Path(task_dir), workdir
        self.file_mb = int(storage_mb or FILE_CAP_MB)
        self.root = Path(tempfile.mkdtemp(prefix="trl-tools-")).resolve()
        files = self.task_dir / "environment" / "files"
        shutil.copytree(files, self.root / "app") if files.is_dir() else (self.root / "app").mkdir()
        (self.root / "logs").mkdir()
        (self.root / "scratch").mkdir()
        self.tool_calls = self.tool_failures = 0

    def bash(self, **arguments: Any) -> str:
        """Run a shell command in the sandbox's work dir; returns stdout, stderr and exit code."""
        lim = self.limits
        assert self.root is not None, "reset() first"
        self.tool_calls += 1
        args = check_arguments(lim.tool_spec, json.dumps(arguments))
        if isinstance(args, str):  # RL360's error text for bad arguments
            self.tool_failures += 1
            return clip(args, lim.max_tool_output_chars)
        asked = args.get("timeout")
        t = lim.exec_timeout_s if asked is None else max(0.1, min(float(asked),
                                                                  lim.exec_timeout_s))
        argv = [*sandbox_argv([(str(self.root / "app"), self.workdir, True)], self.workdir),
                "/bin/sh", "-c", args["command"]]
        res = run_sandboxed(argv, t, self.root / "scratch", lim.cpu_s, self.file_mb)
        if not res.ok:
            self.tool_failures += 1
        text = clip(format_exec(res, t), lim.max_output_chars)
        return clip(text, lim.max_tool_output_chars)

    def _verify(self, timeout_s: float) -> float:
        """The task's tests/test.sh with the episode's work dir, /tests and a fresh /logs;
        the reward is /logs/verifier/reward.txt (missing or unreadable: 0)."""
        assert self.root is not None and self.task_dir is not None, "reset() first"
        logs = self.root / "logs"
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir()
        binds = [(str(self.root / "app"), self.workdir, True),
                 (str(self.task_dir / "tests"), "/tests", False), (str(logs), "/logs", True)]
        run_sandboxed([*sandbox_argv(binds, "/tests"), "bash", "/tests/test.sh"], timeout_s,
                      self.root / "scratch", int(timeout_s) + 1, FILE_CAP_MB)
        try:
            value = float((logs / "verifier" / "reward.txt").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0.0
        return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0

    def _cleanup(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


# ----------------------------------------------------------------------------- parsing


def use_rl360_parser(tokenizer: Any) -> None:
    """TRL parses a reply with `tokenizer.parse_response`; here that is RL360's parser, so a
    call RL360 runs TRL runs too (a malformed call stays text: no call, the episode ends)."""
    from rl360.policies.chat import ChatRenderer

    renderer = ChatRenderer(tokenizer)

    def parse_response(ids: Any, prefix: Any = None, tools: Any = None) -> dict[str, Any]:
        text = tokenizer.decode(list(ids), skip_special_tokens=True)
        parsed = renderer.parse_assistant(text)
        out: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            out["tool_calls"] = [{"type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": json.loads(c.function.arguments)}}
                                 for c in parsed.tool_calls]
        return out

    tokenizer.response_template = RESPONSE_TEMPLATE
    tokenizer.parse_response = parse_response


# ----------------------------------------------------------------------------- reward


@dataclass
class BatchStats:
    rewards: list[float]
    turns: list[int]
    tool_calls: list[int]
    final_answer: list[bool]
    t_begin: float
    t_end: float


class Verifier:
    """TRL's reward function: each rollout's verifier, on `workers` threads."""

    __name__ = "verifier"

    def __init__(self, timeout_of: dict[str, float], stop_ids: list[int], workers: int) -> None:
        self.timeout_of = timeout_of
        self.stop_ids = set(stop_ids)
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="verify")
        self.last: BatchStats | None = None

    def __call__(self, prompts: list[Any], completions: list[list[dict[str, Any]]],
                 completion_ids: list[list[int]], environments: list[BashEpisode],
                 task_id: list[str], **_: Any) -> list[float]:
        t0 = time.monotonic()
        rewards = list(self.pool.map(lambda e, t: e._verify(self.timeout_of[t]), environments,
                                     task_id))
        turns = [sum(m.get("role") == "assistant" for m in c) for c in completions]
        calls = [sum(len(m.get("tool_calls") or []) for m in c if m.get("role") == "assistant")
                 for c in completions]
        # a final answer: a last reply with no call that ended at a stop token (RL360's "ok";
        # one cut at the token limit is "truncated")
        final = [bool(c) and c[-1].get("role") == "assistant" and not c[-1].get("tool_calls")
                 and bool(ids) and ids[-1] in self.stop_ids
                 for c, ids in zip(completions, completion_ids, strict=True)]
        self.last = BatchStats(rewards, turns, calls, final, t0, time.monotonic())
        return rewards
