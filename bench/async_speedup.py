"""Async speedup on real work: the same recipe run synchronously (max_staleness = 0) and
asynchronously (max_staleness = 2 by default, `--staleness`; in-flight weight updates),
alternating, 3 runs each.

The work is real: the torch engine samples every token from a freshly initialised Llama-shaped
policy (byte-level vocabulary; a completion ends at the end-of-turn token or at one of a few
stop bytes, so lengths are long-tailed: most episodes are short, a few run to max_tokens), every
answer is graded in the sandbox by the isolated test runner (bench/async_env.py; 3 tests a task,
graders at nice 0: see TESTS and the recipe below), and the torch trainer takes a PPO step on
every batch and publishes its weights to the engine. Disaggregated
hardware is emulated on one host: core 0 is the rollout machine, core 1 the trainer's. Ray's
head is started on core 0, so every process it starts (engine replica, session shard, env
actors and their sandboxes, controller, buffer, Serve) runs there; the trainer rank moves
itself to core 1 (trainer.cpu_affinity; engine and env actors are also pinned by their own
keys; one torch thread each), and so does the driver: its loop (wait for a batch, train,
publish, log) is the trainer's critical path, and on the saturated rollout core its plain
actor calls stalled for 10-16 s (measured: a `.remote()` submit or a status `ray.get` taking
as long as the generation batch running beside it; none with the driver on core 1). The
trainer micro-batches by length under a token budget (`--micro-batch-tokens`), so its step
costs what its real tokens cost, not the whole batch padded to the one longest answer. The
model, batch and the trainer's passes over a batch (`--epochs`, trainer.epochs) are sized so
that a generation batch alone and a training step alone take similar time.

Why staleness 2: a batch is done when its longest episode is, and that one decodes its 256
tokens one step after another, so a batch takes at least L = 256 decode steps whatever the
engine's throughput. With max_staleness = s a batch may start only once the trainer has
published the version s before it, so in steady state (s + 1) steps must cover L' + s T + D
(L' the latency with the next batches' rows in the same decode steps, T a training step, D
the publish-to-first-token hand-offs): at s = 1 an async step is at least (L' + T + D) / 2.
Measured on a 2-core VM: L' 5.6-6.7 s against L 4.1 s alone, T 2.9-3.3 s,
async steps alternating 6-8 s / 2.5-3.5 s, mean 4.9-5.5 s, ratio 1.2-1.4; at s = 2 the
trainer, not the tail, sets the step.

From each run's steps (the first `--skip` left out: start-up and pipeline fill):
  - sync runs: generation alone = the time the trainer waits for a batch (nothing else runs),
    training alone = the trainer step + the weight publish (nothing else runs), sync step
  - async runs: async step
  - ratio = sync step / async step; pipeline efficiency = max(gen alone, train alone) / async step
  - per in-flight weight swap, the longest pause of a running sequence across it (measured on
    the engine thread) against that swap + one decode step of the same rows (the plain step
    right before the swap); the verdict (pause_verdict) holds when the typical swap adds at
    most a tenth of a decode step beyond that budget and no swap exceeds it by more than the
    engine's own worst step-to-step change with no swap (the control)

    .venv/bin/python bench/async_speedup.py [--runs 3] [--steps 14] [--skip 5] [--epochs 1]
        [--micro-batch-tokens 1024] [--set KEY=VALUE ...] [--out DIR] [--record FILE]

Last line: {"bench": "async_speedup", "ours": <async step s>, "baseline": <sync step s>,
"ratio": <sync/async>, "efficiency": ...}
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "offline")
# the env actors import bench.async_env: Ray's workers inherit this
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
sys.path.insert(0, str(ROOT))

ROLLOUT_CORE, TRAINER_CORE = 0, 1
nan = float("nan")
STOP_BYTES = ".\n"  # with <|im_end|>: 3 of 320 tokens end a completion
# Tests over the answer text, each passed by about half of random answers (`% 3 != 0` by ~2/3),
# near-independent. A task gets 3 of them (reward: the fraction passed, 4 levels), so a group of
# 8 almost never scores alike: a zero-variance group has no advantage and the trainer skips its
# tokens, and with 2 groups a batch such skips made one training step cost 3 s and the next 24 s.
TESTS = [
    "assert len(answer()) % 2 == 0",
    "assert len(set(answer())) % 2 == 0",
    "assert sum(map(ord, answer())) % 2 == 0",
    "assert sum(map(ord, answer())) % 3 != 0",
    "assert (len(answer()) // 2) % 2 == 0",
]
TESTS_PER_TASK = 3


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


@contextlib.contextmanager
def ray_head(num_cpus: int = 2):  # type: ignore[no-untyped-def]
    """One local Ray head for every run (each run joins it: no Ray start-up per run), started
    here with `ray start --block` in its own process group and ended by that group's id."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_cli = Path(sys.executable).parent / "ray"
    proc = subprocess.Popen(
        [str(ray_cli), "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
         "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        # the rollout machine: Ray's processes and every worker they start inherit core 0
        preexec_fn=lambda: os.sched_setaffinity(0, {ROLLOUT_CORE}))
    address = f"127.0.0.1:{port}"
    try:
        import ray

        for _ in range(600):  # until the head answers (a loaded box takes a while)
            try:
                ray.init(address=address, namespace="probe", log_to_driver=False)
                ray.shutdown()
                break
            except Exception:
                if proc.poll() is not None:
                    raise RuntimeError(f"ray start exited with {proc.returncode}") from None
                time.sleep(1.0)
        yield address
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


class CoreSampler:
    """Each core's busy share over time (/proc/stat, every 0.5 s, on a daemon thread): shows
    whether a mode leaves a core idle (a pipeline bubble) or saturates it (contention)."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.samples: list[tuple[float, list[tuple[int, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True,
                                        name="core-sampler")

    @staticmethod
    def read() -> list[tuple[int, int]]:
        """(busy, total) jiffies of every core."""
        out = []
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3].isdigit():
                    v = [int(x) for x in line.split()[1:]]
                    idle = v[3] + v[4]  # idle + iowait
                    out.append((sum(v) - idle, sum(v)))
        return out

    def _loop(self, period_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.read()))
            self._stop.wait(period_s)

    def __enter__(self) -> CoreSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self, t0: float, t1: float) -> list[float]:
        """Each core's busy share between the samples nearest t0 and t1."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return []
        (_, a), (_, b) = inside[0], inside[-1]
        return [(bb - ab) / max(1, bt - at) for (ab, at), (bb, bt) in zip(a, b, strict=True)]


def make_workload(d: Path, args: argparse.Namespace) -> tuple[Path, Path, list[int]]:
    from rl360.policies.tiny import TinyModelSpec, build_tiny_tokenizer, save_tiny_policy

    spec = TinyModelSpec(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), seed=1)
    model = save_tiny_policy(d / "policy", spec)
    tok = build_tiny_tokenizer()
    stops = [tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(tok.encode(c))[0]) for c in STOP_BYTES]
    tasks = d / "tasks.jsonl"
    with tasks.open("w") as f:
        for i in range(64):
            f.write(json.dumps({"id": f"text-{i:02d}", "entry_point": "answer",
                                "instruction": f"Write anything at all, note {i}.",
                                "tests": [TESTS[(i + j) % len(TESTS)]
                                          for j in range(TESTS_PER_TASK)]}) + "\n")
    return model, tasks, stops


def _median_known(xs: Iterable[Any]) -> float:
    """The median of the figures a step logged (a step logs none, null, when the engine's
    health was not reported again since the step before)."""
    known = [float(x) for x in xs if x is not None]
    return statistics.median(known) if known else nan


def run(mode: str, args: argparse.Namespace, model: Path, tasks: Path, stops: list[int],
        out: Path, idx: int, address: str) -> list[dict]:
    from rl360.launch.train_run import run_train
    from rl360.recipe import apply_overrides, decode_recipe

    staleness = 0 if mode == "sync" else args.staleness
    name = f"{mode}{idx}"
    recipe = decode_recipe(apply_overrides({}, [
        f"run.name='{name}'", f"run.out_dir={json.dumps(str(out))}", f"run.seed={idx}",
        f"model.path={json.dumps(str(model))}", "model.max_model_len=512",
        f"ray.address='{address}'", "ray.dashboard=false",
        "engine.backend='torch'", "engine.num_cpus=0.5", "engine.threads=1",
        f"engine.cpu_affinity=[{ROLLOUT_CORE}]", "engine.weight_update='inflight'", "engine.batch_wait_ms=2",
        "engine.max_batch_size=64", "engine.prefix_cache_mb=0",
        "trainer.num_cpus=0.5", "trainer.threads=1", f"trainer.cpu_affinity=[{TRAINER_CORE}]",
        f"trainer.epochs={args.epochs}",
        "trainer.lr=1e-5", f"trainer.micro_batch_size={args.group_size * args.groups}",
        f"trainer.micro_batch_tokens={args.micro_batch_tokens}",
        "env.env='bench.async_env:AnswerTextEnv'", "env.actors=2", "env.episodes_per_actor=64",
        f"env.cpu_affinity=[{ROLLOUT_CORE}]",
        # graders at full weight beside the engine: on the hardware this emulates the engine
        # computes on an accelerator and never takes a grader's CPU. At the default nice 10
        # (autogroup weight 110 against Ray's 1024) grading an episode took 2.8 s in async runs
        # (1.7 s sync) against 0.3 s here, and groups waiting on it held in-flight slots
        "env.limits.nice=0",
        "env.max_turns=1", "serve.session_shards=1",
        f"train.steps={args.steps}", f"train.group_size={args.group_size}",
        f"train.groups_per_batch={args.groups}", f"train.max_staleness={staleness}",
        f"train.max_in_flight_groups={(args.staleness + 1) * args.groups}", "train.filter_zero_variance=false",
        f"train.tasks=[{json.dumps(str(tasks))}]", "train.checkpoints.every=0",
        "train.wandb='disabled'", "train.sampling.temperature=1.0",
        f"train.sampling.max_tokens={args.max_tokens}", f"train.sampling.stop_token_ids={stops}",
        *args.set,
    ]))
    t0 = time.monotonic()
    with CoreSampler() as cores, contextlib.redirect_stdout(io.StringIO()):
        run_train(recipe)
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").open()]
    kept = rows[args.skip:]
    # the kept steps' window (elapsed_s counts from run_train's start, ~t0)
    busy = cores.busy(t0 + rows[args.skip - 1]["elapsed_s"] if args.skip else t0,
                      t0 + rows[-1]["elapsed_s"])
    # per run, the mean over the kept steps (the run's throughput): an async run settles into
    # a period of two (a step that waits for two batches finishing together, then one that
    # waits for none), where a median picks one of the two modes
    mean = lambda k: statistics.fmean(r[k] for r in kept)  # noqa: E731
    res = {"step": mean("step_s"), "wait": mean("wait_s"), "train": mean("train_s"),
           "sync": mean("sync_s"),
           "tokens": statistics.median(r["gen_tokens_per_s"] * r["step_s"] for r in kept),
           # the trained batch's tokens: an async batch holds the groups that settled first,
           # so it can be lighter than a sync one (the per-token ratio below shows by how much)
           "trained": statistics.median(r.get("tokens") or 0 for r in kept),
           "pause": max((r.get("engine_sync_pause_max_s", 0.0) for r in rows), default=0.0),
           "excess": max((r.get("engine_sync_pause_excess_max_s", 0.0) for r in rows), default=0.0),
           "over": max((r["engine_sync_pause_over_budget_max_s"] for r in rows
                        if "engine_sync_pause_over_budget_max_s" in r), default=float("nan")),
           "swap": max((r.get("engine_last_swap_s", 0.0) for r in rows), default=0.0),
           "decode": statistics.median(r.get("engine_step_median_s", 0.0) for r in rows),
           # the control: how much a plain decode step took longer than the one before it
           "change_max": max((r.get("engine_step_change_max_s", 0.0) for r in rows), default=0.0),
           "change_p95": max((r.get("engine_step_change_p95_s", 0.0) for r in rows), default=0.0),
           # per swap whose step before was a plain step of the same rows: pause - swap - that
           # step, the run's median and worst (the engine keeps them over the whole run)
           "over_med": rows[-1].get("engine_sync_over_median_s", nan),
           "over_max": rows[-1].get("engine_sync_over_max_s", nan),
           "staleness": max(r["staleness_max"] for r in rows), "reward": kept[-1]["reward_mean"],
           "engine_idle": _median_known(r.get("engine_idle_frac") for r in kept),
           "trainer_step": statistics.median(r.get("trainer_step_s") or 0.0 for r in kept),
           "zero_var": sum(r.get("groups/zero_variance") or 0 for r in kept),
           "groups": sum(r.get("groups/total") or 0 for r in kept),
           "verify": statistics.median(r.get("time/episode/verify_s") or 0.0 for r in kept),
           "cores": busy, "wall": time.monotonic() - t0}
    print(f"  {mode:5s} run {idx}: step {res['step']:.2f}s (trainer waits {res['wait']:.2f}s, "
          f"trains {res['train']:.2f}s, publishes {res['sync']:.2f}s), {res['tokens']:.0f} "
          f"generated tokens/batch, {res['trained']:.0f} trained, staleness max "
          f"{res['staleness']:.0f}, "
          f"{len(rows)} steps in {res['wall']:.0f}s with start-up; engine idle "
          f"{res['engine_idle']:.0%}, trainer step {res['trainer_step']:.2f}s, cores busy "
          f"{' / '.join(f'{b:.0%}' for b in busy)}; zero-variance groups {res['zero_var']}/"
          f"{res['groups']}, grading {res['verify']:.2f}s an episode (kept steps); load "
          f"{loadavg()}", flush=True)
    res["mode"] = mode
    res["staleness_cap"] = staleness
    return [res]


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}s [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--skip", type=int, default=5, help="first steps of a run left out")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2, help="groups per batch")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--staleness", type=int, default=2, help="the async runs' max_staleness "
                    "(the sync runs: 0); staleness + 1 batches of groups may be in flight")
    ap.add_argument("--epochs", type=int, default=1, help="trainer passes (optimizer steps) "
                    "per batch: sizes a training step against a generation batch")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override for both modes (repeatable), e.g. "
                    "engine.max_batch_size=32")
    ap.add_argument("--out", default="", help="keep the runs' directories (metrics.jsonl, "
                    "logs) under this directory (default: a temporary one)")
    ap.add_argument("--micro-batch-tokens", type=int, default=1024,
                    help="the trainer's padded tokens per micro-batch (0: the whole batch in one)")
    ap.add_argument("--record", default="", help="JSONL file: add this invocation's runs to it "
                    "and report over every run it holds (e.g. 3 x --runs 1, each under the lock)")
    args = ap.parse_args()
    os.sched_setaffinity(0, {TRAINER_CORE})  # the driver drives the trainer: its machine
    load0 = loadavg()
    res: dict[str, list[dict]] = {"sync": [], "async": []}
    if args.record and Path(args.record).exists():
        for line in Path(args.record).read_text().splitlines():
            r = json.loads(line)
            res[r["mode"]].append(r)
        print(f"{len(res['sync'])} sync and {len(res['async'])} async runs from {args.record}")
    with tempfile.TemporaryDirectory() as d, ray_head() as address:
        model, tasks, stops = make_workload(Path(d), args)
        print(f"workload: {args.groups} groups x {args.group_size} episodes a batch, policy "
              f"hidden {args.hidden} x {args.layers} layers (fresh init, byte vocabulary), "
              f"max_tokens {args.max_tokens}, stop ids {stops} + end of turn, {args.epochs} "
              f"trainer epoch(s) a batch, micro-batches of <= {args.micro_batch_tokens} padded "
              f"tokens, async runs at max_staleness {args.staleness}; Ray, the engine and env "
              f"actors on core {ROLLOUT_CORE}, the trainer and the driver on core "
              f"{TRAINER_CORE}, one torch thread each; {args.runs} runs each, alternating, "
              f"{args.steps} steps a run, first {args.skip} left out; load before {load0}",
              flush=True)
        first = len(res["sync"])  # runs already recorded: new seeds for these
        for i in range(first, first + args.runs):
            for mode in ("sync", "async"):
                got = run(mode, args, model, tasks, stops, Path(args.out or Path(d) / "runs"),
                          i, address)
                res[mode] += got
                if args.record:
                    with open(args.record, "a") as f:
                        f.write(json.dumps({**got[0], "load": loadavg()}) + "\n")
    report(res, load0)


TYPICAL_SHARE = 0.1  # of a decode step: the thread hand-offs around a swap (see pause_verdict)


def _ms(seconds: float) -> float | None:
    """Milliseconds for the JSON line; None where not measured (NaN is not JSON)."""
    return round(seconds * 1e3, 2) if seconds == seconds else None


def pause_verdict(runs: list[dict]) -> str:
    """The bar "a running sequence's pause across a swap is below one decode step plus the
    swap", judged per async run over its swaps v = pause - swap - the plain decode step of the
    same rows right before it. A pause is the swap, one decode step and the thread hand-offs
    around them, so v is that step's change over the one before plus the hand-offs: with no
    cost from the swap it is as noisy as any step-to-step change. Holds when the typical swap
    (median v) costs no more than TYPICAL_SHARE of the run's median decode step, and no swap
    (max v) is slower than the worst plain step-to-step change of the same run (the control).
    A swap that waited for a drain, or slowed the next step (Ray's nice 15 did: +15-30 ms a
    swap), fails the first; a rare stall at a swap fails the second."""
    if not runs or any(r.get("over_med", nan) != r.get("over_med", nan) for r in runs):
        return "not measured"  # runs recorded before the engine kept these figures
    good = all(r["over_med"] <= TYPICAL_SHARE * r["decode"] and r["over_max"] <= r["change_max"]
               for r in runs)
    return "below" if good else "NOT below"


def report(res: dict[str, list[dict]], load0: str) -> None:
    """The summary over every run: step times, ratio, efficiency, per-token ratio, pauses."""
    s, a = res["sync"], res["async"]
    gen = [r["wait"] for r in s]
    train = [r["train"] + r["sync"] for r in s]
    sync_step = [r["step"] for r in s]
    async_step = [r["step"] for r in a]
    g, t = statistics.median(gen), statistics.median(train)
    ss, as_ = statistics.median(sync_step), statistics.median(async_step)
    ratio, eff = ss / as_, max(g, t) / as_
    print(f"generation alone {spread(gen)} | training alone (step + publish) {spread(train)}")
    print(f"sync step {spread(sync_step)} | async step {spread(async_step)} | ratio {ratio:.2f} "
          f"(goal >= 1.6) | pipeline efficiency {eff:.2f} (goal >= 0.85)")
    # the same figures per trained token (a step's time / its batch's tokens, medians)
    # (runs recorded before this figure existed have no "trained": left out of it)
    counted = {m: [r for r in res[m] if r.get("trained")] for m in ("sync", "async")}
    tok_ratio = float("nan")
    if counted["sync"] and counted["async"]:
        per_k = {m: statistics.median(r["step"] / r["trained"] * 1e3 for r in rs)
                 for m, rs in counted.items()}
        trained = {m: statistics.median(r["trained"] for r in rs) for m, rs in counted.items()}
        tok_ratio = per_k["sync"] / per_k["async"]
        print(f"per 1000 trained tokens: sync {per_k['sync']:.2f}s, async {per_k['async']:.2f}s, "
              f"ratio {tok_ratio:.2f} (trained tokens a batch: sync {trained['sync']:.0f}, "
              f"async {trained['async']:.0f})")
    pause = max(r["pause"] for r in a)
    excess = max(r["excess"] for r in a)
    over = max(r["over"] for r in a)
    decode = statistics.median(r["decode"] for r in a)
    verdict = pause_verdict(a)
    print(f"in-flight weight swaps: the longest pause of a running sequence {pause * 1e3:.1f} ms "
          f"(median decode step {decode * 1e3:.1f} ms, longest swap logged "
          f"{max(r['swap'] for r in a) * 1e3:.1f} ms); from the end of the step before, beyond "
          f"the swap + the step right after it: {excess * 1e3:.2f} ms at most (a pause also "
          f"holds the rest of a step before that prefilled new rows after stamping the "
          f"running ones)")
    print(f"  per swap, pause - (that swap + the plain decode step of the same rows before it): "
          f"median {max(r.get('over_med', nan) for r in a) * 1e3:+.1f} ms (goal <= "
          f"{TYPICAL_SHARE:.0%} of the run's median decode step), worst "
          f"{max(r.get('over_max', nan) for r in a) * 1e3:+.1f} ms (goal <= the control's worst) "
          f"-> {verdict}")
    print(f"  control, plain decode steps with no swap: a step took longer than the plain step "
          f"of the same rows before it by up to {max(r.get('change_max', 0.0) for r in a) * 1e3:.1f} ms "
          f"(95th percentile {max(r.get('change_p95', 0.0) for r in a) * 1e3:.1f} ms, worst run)")
    print(f"  (the single-sample form, every swap below its own step before: {over * 1e3:+.1f} ms at "
          f"worst -> {'holds' if over < 0 else 'does not hold'}; identical step times with noise "
          f"fail it at about half the swaps)")
    print(f"load before {load0}, after {loadavg()} (on a shared machine the figures move with "
          "the load)")
    print(json.dumps({"bench": "async_speedup", "ours": round(as_, 3), "baseline": round(ss, 3),
                      "ratio": round(ratio, 3), "efficiency": round(eff, 3),
                      "ratio_per_token": round(tok_ratio, 3) if tok_ratio == tok_ratio else None,
                      "gen_alone_s": round(g, 3), "train_alone_s": round(t, 3),
                      "sync_pause_ms": round(pause * 1e3, 2),
                      "step_change_max_ms": round(max(r.get("change_max", 0.0) for r in a) * 1e3, 2),
                      "sync_pause_excess_ms": round(excess * 1e3, 2),
                      "sync_pause_over_step_before_ms": round(over * 1e3, 2),
                      "sync_over_median_ms": _ms(max(r.get("over_med", nan) for r in a)),
                      "sync_over_max_ms": _ms(max(r.get("over_max", nan) for r in a)),
                      "pause_verdict": verdict,
                      "runs": [len(s), len(a)], "load": loadavg()}))


if __name__ == "__main__":
    main()
