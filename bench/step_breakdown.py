"""Where a `make demo` step goes: wall phases, per-episode phases and CPU time per role.

Runs `rl360 train recipes/cpu-demo.toml` for a few steps (the cached warm start in
runs/cpu-demo-warmstart; `rl360 sft` makes it first when it is missing) in a fresh run
directory, and meanwhile samples /proc for every process of the run (the driver and everything
it started: Ray's own daemons, the workers, the sandboxes under the env actors). After the
warm-up steps it prints, per step:

- wall time: waiting for the batch (the rollout of the step's episodes), the trainer, the weight
  sync, the driver's bookkeeping (the `time/*` step metrics);
- per episode: the env actor's phases (session open/close RPCs, sandbox start, chat turns with
  the server's render / engine / commit share, verify = sandbox grading, cleanup; the
  `time/episode/*` metrics);
- CPU seconds by role: engine replica (forward passes), session shard (HTTP-free session and
  ledger work), env actors (agent loop, RPCs), sandboxes (bwrap and the grading processes),
  controller + buffer, trainer, weight publisher, Serve/Ray system processes, driver; plus the
  idle share of the cores the run was given (`ray.num_cpus`) and the whole box's load.

`--py-spy` also samples every role process with py-spy (`pip install py-spy`) and prints each
role's top functions (by own samples). Last line: one JSON object with each part's share.

    python bench/step_breakdown.py [--steps 6] [--skip 2] [--set key=value ...] [--py-spy]

Figures on a shared machine are noisy: the load (`/proc/loadavg`) is printed with them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")

# (substring of the process title, role), first match wins; children of env actors are sandboxes
ROLES = [
    ("ServeReplica:rl360:engine", "engine"),
    ("SessionShard", "session_shard"),
    ("ServeReplica:rl360:session-server", "serve_http"),
    ("ProxyActor", "serve_http"),
    ("EnvActor", "env_actor"),
    ("rl360-env-", "env_actor"),
    ("RolloutController", "controller_buffer"),
    ("TrajectoryBuffer", "controller_buffer"),
    ("Trainer", "trainer"),
    ("WeightPublisher", "weight_sync"),
    ("MetricsSink", "driver"),
]


def _stat(pid: int) -> tuple[int, float, float, int] | None:
    """(ppid, own CPU s, reaped children's CPU s, start tick) of a process, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    ppid = int(fields[1])
    own = (int(fields[11]) + int(fields[12])) / TICK
    kids = (int(fields[13]) + int(fields[14])) / TICK
    return ppid, own, kids, int(fields[19])


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            "utf-8", "replace")
    except OSError:
        return ""


class Sampler(threading.Thread):
    """Snapshots of the CPU time of every process under `root` (by role), one per tick and one
    each time the run logs a step (the metrics file grows)."""

    def __init__(self, root: int, metrics: Path, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.root, self.metrics, self.interval = root, metrics, interval
        self.roles: dict[tuple[int, int], str] = {}  # (pid, start) -> role, once known
        self.step_snaps: dict[int, tuple[float, dict[tuple[int, int], tuple[str, float, float]]]] = {}
        self.pids: dict[str, set[int]] = collections.defaultdict(set)
        self.stop = threading.Event()

    def snapshot(self) -> dict[tuple[int, int], tuple[str, float, float]]:
        procs = {}
        for d in os.listdir("/proc"):
            if d.isdigit() and (st := _stat(int(d))) is not None:
                procs[int(d)] = st
        children = collections.defaultdict(list)
        for pid, (ppid, *_rest) in procs.items():
            children[ppid].append(pid)
        out = {}
        stack = [(self.root, "driver")]
        while stack:  # walk the run's process tree; a role is inherited by descendants
            pid, parent_role = stack.pop()
            st = procs.get(pid)
            if st is None:
                continue
            key = (pid, st[3])
            role = self.roles.get(key)
            if role is None and pid == self.root:
                role = "driver"
            if role is None:
                title = _title(pid)
                role = next((r for pat, r in ROLES if pat in title), None)
                if parent_role == "env_actor":
                    role = "sandbox"
                elif parent_role in ("sandbox", "engine", "session_shard", "trainer"):
                    role = parent_role
                elif role is None:
                    # ray::IDLE workers get an actor later: decide again next tick
                    role = "ray_system" if "ray::IDLE" not in title else None
                if role is not None and title.startswith("ray::") and "IDLE" not in title:
                    self.roles[key] = role  # a worker's title names its actor from now on
            role = role or "ray_system"
            self.pids[role].add(pid)
            out[key] = (role, st[1], st[2])
            stack.extend((c, role) for c in children.get(pid, []))
        return out

    def run(self) -> None:
        seen = 0
        while not self.stop.is_set():
            snap = self.snapshot()
            try:
                rows = self.metrics.read_text().splitlines() if self.metrics.exists() else []
            except OSError:
                rows = []
            if len(rows) > seen:
                for line in rows[seen:]:
                    step = json.loads(line).get("step")
                    if isinstance(step, int):
                        self.step_snaps[step] = (time.monotonic(), snap)
                seen = len(rows)
            self.stop.wait(self.interval)


def cpu_by_role(a: dict, b: dict) -> dict[str, float]:
    """CPU seconds per role between snapshots a and b. A process's own time counts for its
    role; time its reaped children used counts for the role its children have (an env actor's
    children are sandboxes)."""
    out: dict[str, float] = collections.defaultdict(float)
    for key, (role, own, kids) in b.items():
        own0, kids0 = (a[key][1], a[key][2]) if key in a else (0.0, 0.0)
        out[role] += own - own0
        out["sandbox" if role == "env_actor" else role] += kids - kids0
    return dict(out)


def _pyspy(pids: dict[str, set[int]], seconds: int, out_dir: Path) -> list[subprocess.Popen]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    procs = []
    for role, ps in pids.items():
        if role in ("sandbox", "ray_system"):
            continue
        for pid in ps:
            if not Path(f"/proc/{pid}").exists():
                continue
            procs.append(subprocess.Popen(
                [exe, "record", "--nonblocking", "-r", "20", "-d", str(seconds), "-f", "raw",
                 "-o", str(out_dir / f"{role}.{pid}.txt"), "-p", str(pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


# leaf frames where a thread waits (Ray's core worker and Serve's loops block in C, which
# py-spy does not see as idle): left out of the shares
_WAITING = ("Worker.main_loop", "Thread.run", "Condition.wait", "_run_router_event_loop",
            "_run_user_code_event_loop", "EpollSelector.select", "select ", "sleep ")


def _pyspy_report(out_dir: Path, top: int = 8) -> None:
    for f in sorted(out_dir.glob("*.txt")):
        own: collections.Counter[str] = collections.Counter()
        total = waiting = 0
        for line in f.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not n.isdigit():
                continue
            frames = stack.split(";")
            leaf = frames[-1].strip() if frames else ""
            name = leaf.split(" (")[0] + " " + leaf.split("/")[-1].rstrip(")")
            total += int(n)
            if not leaf or any(w in name for w in _WAITING):
                waiting += int(n)
                continue
            own[name] += int(n)
        busy = total - waiting
        if not busy:
            continue
        print(f"  py-spy {f.stem}: {total} samples, {busy} not waiting; top own frames "
              "(% of those):")
        for name, n in own.most_common(top):
            print(f"    {100 * n / busy:5.1f}%  {name[:110]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "cpu-demo.toml"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the figures")
    ap.add_argument("--set", action="append", default=[], help="recipe overrides, key=value")
    ap.add_argument("--py-spy", action="store_true", help="also sample the roles with py-spy")
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    args = ap.parse_args()
    if args.steps <= args.skip:
        ap.error("--steps must exceed --skip")

    out_dir = Path(tempfile.mkdtemp(prefix="rl360-step-breakdown-"))
    warm = ROOT / "runs" / "cpu-demo-warmstart"
    cmd = [sys.executable, "-m", "rl360", "train", args.recipe,
           "--set", f"train.steps={args.steps}", "--set", f"run.out_dir={out_dir}",
           "--set", "run.name=bench", "--set", "train.checkpoints.every=0",
           "--set", "train.max_minutes=0", "--set", "ray.dashboard=false"]
    if not warm.exists():
        print("no cached warm start: the run makes it first (rl360 sft, minutes)", flush=True)
    for kv in args.set:
        cmd += ["--set", kv]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "offline"}
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    print(f"workload: {args.recipe} for {args.steps} steps (first {args.skip} left out), "
          f"overrides {args.set or 'none'}; load {' '.join(load0)}", flush=True)
    log_path = out_dir / "train.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        metrics = out_dir / "bench" / "metrics.jsonl"
        sampler = Sampler(proc.pid, metrics)
        sampler.start()
        spy_dir = out_dir / "py-spy"
        spies: list[subprocess.Popen] = []
        while proc.poll() is None:
            if args.py_spy and not spies and args.skip in sampler.step_snaps:
                spy_dir.mkdir(exist_ok=True)
                last = sorted(sampler.step_snaps)
                secs = 2 * (sampler.step_snaps[last[-1]][0] - sampler.step_snaps[last[0]][0]) \
                    / max(1, len(last) - 1) if len(last) > 1 else 20
                spies = _pyspy(sampler.pids, max(5, int(secs * (args.steps - args.skip) / 2)),
                               spy_dir)
            time.sleep(0.5)
        sampler.stop.set()
        sampler.join()
        for s in spies:
            s.wait()
    load1 = Path("/proc/loadavg").read_text().split()[:3]
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [r for r in rows if isinstance(r.get("step"), int) and r["step"] > args.skip]
    if proc.returncode != 0 or len(steps) < args.steps - args.skip or args.skip not in sampler.step_snaps:
        print(f"the run failed (exit {proc.returncode}); its log: {log_path}", file=sys.stderr)
        print(log_path.read_text()[-3000:], file=sys.stderr)
        return 1
    n = len(steps)
    t0, snap0 = sampler.step_snaps[args.skip]
    t1, snap1 = sampler.step_snaps[max(sampler.step_snaps)]
    wall = t1 - t0
    step_s = [r["step_s"] for r in steps]

    def mean(key: str) -> float:
        vals = [r[key] for r in steps if isinstance(r.get(key), int | float)]
        return statistics.fmean(vals) if vals else 0.0

    print(f"\nstep time over steps {args.skip + 1}-{args.steps}: median {statistics.median(step_s):.2f} s "
          f"(min {min(step_s):.2f}, max {max(step_s):.2f}); episodes/step "
          f"{mean('episodes'):.0f}; reward {mean('reward_mean'):.3f}; load {' '.join(load1)}")
    wall_parts = {k: mean(f"time/{k}_s") for k in ("rollout_wait", "train", "sync", "bookkeeping")}
    print("\nwall time per step (s):")
    for k, v in wall_parts.items():
        print(f"  {k:<14} {v:6.2f}  {100 * v / mean('step_s'):5.1f}%")
    print(f"  engine busy    {mean('time/engine_busy_s'):6.2f}  (model steps, inside the rollout)")

    ep = {k[len("time/episode/"):]: mean(k) for k in steps[-1] if k.startswith("time/episode/")}
    print("\nper episode, mean seconds (episodes run concurrently: these overlap):")
    for k, v in sorted(ep.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<22} {v:7.3f}")

    cpu = cpu_by_role(snap0, snap1)
    try:  # the CPUs the run asked Ray for (the resolved recipe it wrote)
        ray_cfg = json.loads((out_dir / "bench" / "recipe.json").read_text())["ray"]
        cores = float(ray_cfg.get("num_cpus") or os.cpu_count() or 1)
    except (OSError, ValueError, KeyError, TypeError):
        cores = float(os.cpu_count() or 1)
    total = sum(cpu.values())
    idle = max(0.0, cores * wall - total)
    print(f"\nCPU seconds per step by role ({cores:g} cores x {wall / n:.2f} s = "
          f"{cores * wall / n:.2f} core-s a step):")
    for role, v in sorted(cpu.items(), key=lambda kv: -kv[1]):
        print(f"  {role:<18} {v / n:6.2f}  {100 * v / (cores * wall):5.1f}% of the cores")
    print(f"  {'idle / others':<18} {idle / n:6.2f}  {100 * idle / (cores * wall):5.1f}%")

    if args.py_spy:
        print("\npy-spy (own samples per frame, per role process):")
        _pyspy_report(spy_dir)
    if args.keep:
        print(f"\nrun directory kept: {out_dir}")
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
    denom = cores * wall
    print(json.dumps({
        "bench": "step_breakdown", "ours": round(statistics.median(step_s), 3), "baseline": None,
        "ratio": None, "unit": "s/step (median)", "steps": n, "load": load1,
        "wall_share": {k: round(v / mean("step_s"), 3) for k, v in wall_parts.items()},
        "cpu_s_per_step": {k: round(v / n, 3) for k, v in sorted(cpu.items())},
        "cpu_share": {**{k: round(v / denom, 3) for k, v in sorted(cpu.items())},
                      "idle": round(idle / denom, 3)},
        "episode_s": {k: round(v, 4) for k, v in sorted(ep.items())},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
