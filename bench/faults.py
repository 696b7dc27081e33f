"""Fault drills on a longer run: what each injected fault costs.

Phase 1: one `rl360 train` on the tiny model (code tasks, bwrap sandboxes) that loses, one
after another, an env actor, an engine replica, a session shard and the weight publisher
(`train.inject_faults`, each a few steps apart). Phase 2: another run whose driver is killed
with `kill -9` mid-run (after --kill-after metrics rows) and then resumed with `--resume`.
Each run's ledger (<run dir>/ledger.jsonl, rl360.actors.run_ledger) gives, per fault, the
episodes re-run, the task occurrences lost and duplicated, and the recovery time (from the
kill to the end of the next step that trained; for the driver: from the kill to the end of the
resumed run's first step, which includes starting Ray, Serve and the actors again). Phase 3:
a run with the sharded collective weight sync (2 fsdp trainer ranks, 2 engine replicas) that
loses a replica (killed after step --gap) and then has one stall (SIGSTOP before the weight
sync of step 2 x --gap): per fault the same figures, plus the stall's one line (the replica, the
version, the timeout it was named within) and whether the replacement replicas took the newest
version (the last synced step's replicas and epoch).

    .venv/bin/python bench/faults.py [--steps 10] [--gap 2] [--kill-after 2]

Run it alone on the machine (its runs are timed). Last line:
{"bench": "faults", "lost": <total>, "duplicated": <total>, "episodes_rerun": ..., "faults": [...]}
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rl360.actors.run_ledger import account, read_ledger  # noqa: E402
from rl360.ray_session import free_port  # noqa: E402

PARTS = ("env_actor", "engine", "shard", "publisher")
GROUP_SIZE = 4
# phase 3: the sharded collective weight sync between 2 fsdp ranks and 2 engine replicas
COLLECTIVE = ("engine.replicas=2", "engine.num_cpus=0.25", "trainer.backend='fsdp'",
              "trainer.workers=2", "trainer.num_cpus=0.25",
              "train.weight_sync={transport='collective', sharded=true, bucket_mb=0.05, "
              "timeout_min_s=8.0, timeout_factor=2.0}")


def cmd(out: Path, name: str, steps: int, *sets: str) -> list[str]:
    base = [
        f"run.name={name}", f"run.out_dir={json.dumps(str(out))}", "model.path='tiny'",
        "ray.dashboard=false", f"serve.port={free_port()}", "env.actors=2",
        "serve.session_shards=2", "engine.replicas=1", "engine.num_cpus=0.5",
        "trainer.num_cpus=0.5", f"train.steps={steps}", f"train.group_size={GROUP_SIZE}",
        "train.groups_per_batch=4", "train.tasks=['examples/tasks/code.jsonl']",
        "train.sampling.max_tokens=16", "train.checkpoints.every=1", "train.wandb='disabled'",
        "train.max_staleness=1", "train.init=''", "train.max_in_flight_groups=8", *sets,
    ]
    args = [sys.executable, "-m", "rl360", "train", "recipes/cpu-demo.toml"]
    for s in base:
        args += ["--set", s]
    return args


ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
       "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}


def metrics_rows(run: Path) -> list[dict]:
    p = run / "metrics.jsonl"
    return [json.loads(x) for x in p.open()] if p.exists() else []


def phase_parts(out: Path, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    faults = [f"{p}@{args.gap * (i + 1)}" for i, p in enumerate(PARTS)]
    t0 = time.monotonic()
    p = subprocess.run(cmd(out, "parts", args.steps, f"train.inject_faults={faults!r}"),
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"phase 1 failed ({p.returncode}):\n{p.stderr[-3000:]}")
    steps = [r["step"] for r in metrics_rows(out / "parts") if "reward_mean" in r]
    acc = account(read_ledger(out / "parts" / "ledger.jsonl"), GROUP_SIZE)
    print(f"phase 1: {args.steps} steps ({steps[-1]} done) in {wall:.0f}s with faults {faults}; "
          f"task occurrences {acc['occurrences']}, lost {acc['lost']}, duplicated "
          f"{acc['duplicated']}, episodes re-run {acc['episodes_rerun']}, episodes lost "
          f"{acc['episodes_lost']}", flush=True)
    return acc, acc["faults"]


def phase_driver(out: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    run = out / "driver"
    steps = args.kill_after + 2
    proc = subprocess.Popen(cmd(out, "driver", steps), cwd=REPO, env=ENV,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while len(metrics_rows(run)) < args.kill_after and time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit("phase 2: the run ended before the kill")
        time.sleep(0.2)
    t_kill = time.time()
    os.killpg(proc.pid, signal.SIGKILL)  # the driver we started and everything it started
    proc.wait()
    killed_at = len(metrics_rows(run))
    p = subprocess.run([*cmd(out, "driver", steps), "--resume"], cwd=REPO, env=ENV,
                       capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"phase 2 resume failed ({p.returncode}):\n{p.stderr[-3000:]}")
    acc = account(read_ledger(run / "ledger.jsonl"), GROUP_SIZE)
    first = next((r for r in read_ledger(run / "ledger.jsonl")
                  if r["kind"] == "step" and r.get("t", 0) > t_kill), None)
    fault = {"part": "driver", "killed": "kill -9 + --resume", "step": killed_at,
             "episodes_rerun": acc["episodes_rerun"], "lost": acc["lost"],
             "duplicated": acc["duplicated"],
             "recovery_s": round(first["t"] - t_kill, 2) if first else None}
    print(f"phase 2: driver killed after {killed_at} steps, resumed to {steps}; task "
          f"occurrences {acc['occurrences']}, lost {acc['lost']}, duplicated "
          f"{acc['duplicated']}, episodes re-run {acc['episodes_rerun']}",
          flush=True)
    return acc, fault


def phase_collective(out: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    faults = [f"engine@{args.gap}", f"engine_stall@{2 * args.gap}"]
    steps = 3 * args.gap + 2
    t0 = time.monotonic()
    p = subprocess.run(cmd(out, "collective", steps, f"train.inject_faults={faults!r}",
                           *COLLECTIVE), cwd=REPO, env=ENV, capture_output=True, text=True,
                       timeout=900)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"phase 3 failed ({p.returncode}):\n{p.stderr[-3000:]}")
    acc = account(read_ledger(out / "collective" / "ledger.jsonl"), GROUP_SIZE)
    rows = [r for r in metrics_rows(out / "collective") if "sync_epoch" in r]
    stall = [x.removeprefix("rl360: ") for x in p.stderr.splitlines()
             if "did not take version" in x]
    last = rows[-1] if rows else {}
    sync = {"stall_lines": stall, "last_sync_replicas": last.get("sync_replicas"),
            "last_sync_epoch": last.get("sync_epoch"),
            "sync_s_max": max((r["sync_s"] for r in rows), default=None)}
    print(f"phase 3: {steps} steps in {wall:.0f}s with faults {faults} (sharded collective "
          f"sync); lost {acc['lost']}, duplicated {acc['duplicated']}, episodes re-run "
          f"{acc['episodes_rerun']}, episodes lost {acc['episodes_lost']}; stall: "
          f"{stall or 'no line'}; last sync to {sync['last_sync_replicas']} replicas in epoch "
          f"{sync['last_sync_epoch']}", flush=True)
    return acc, sync


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--gap", type=int, default=2, help="steps between two injected faults")
    ap.add_argument("--kill-after", type=int, default=2, help="phase 2: kill -9 after N steps")
    ap.add_argument("--only-collective", action="store_true",
                    help="phase 3 alone (the sharded collective weight sync's drills)")
    args = ap.parse_args()
    if args.steps <= args.gap * len(PARTS):
        raise SystemExit(f"--steps must exceed {args.gap * len(PARTS)} (--gap x {len(PARTS)})")
    print(f"load: {open('/proc/loadavg').read().strip()} (figures on a loaded box are noisy)")
    empty = {"lost": 0, "duplicated": 0, "episodes_rerun": 0, "episodes_lost": 0}
    with tempfile.TemporaryDirectory() as d:
        if args.only_collective:
            (acc1, faults), (acc2, driver) = (empty, []), (empty, None)
        else:
            acc1, faults = phase_parts(Path(d), args)
            acc2, driver = phase_driver(Path(d), args)
        acc3, sync = phase_collective(Path(d), args)
    if driver is not None:
        faults.append(driver)
    faults += [{**f, "part": f"{f['part']} (collective)"} for f in acc3["faults"]]
    print(f"{'fault':<24} {'after step':>10} {'re-run':>7} {'lost':>5} {'dup':>4} {'recovery s':>11}")
    for f in faults:
        rec = "-" if f["recovery_s"] is None else f"{f['recovery_s']:.1f}"
        print(f"{f['part']:<24} {f['step']:>10} {f['episodes_rerun']:>7} {f['lost']:>5} "
              f"{f['duplicated']:>4} {rec:>11}")
    accs = (acc1, acc2, acc3)
    print(json.dumps({
        "bench": "faults", "lost": sum(a["lost"] for a in accs),
        "duplicated": sum(a["duplicated"] for a in accs),
        "episodes_rerun": sum(a["episodes_rerun"] for a in accs),
        "episodes_lost": sum(a["episodes_lost"] for a in accs), "collective_sync": sync,
        "faults": [{k: f[k] for k in ("part", "episodes_rerun", "lost", "duplicated",
                                      "recovery_s")} for f in faults],
    }))


if __name__ == "__main__":
    main()
