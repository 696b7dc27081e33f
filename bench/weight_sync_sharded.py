"""Sharded weight sync against the full gather, on CPU (gloo): FSDP2 trainer ranks each sending
their own shards to 2 torch engine replicas, against the path where every rank gathers the
full weights and rank 0 broadcasts them (the flat gloo collective).

    .venv/bin/python bench/weight_sync_sharded.py [--ranks 2 4] [--runs 3] [--bucket-mb 8]

Workload: tiny:sync100m (28M parameters, 113 MB in the trainer's fp32), engines in bf16 (a
version is 57 MB), `--ranks` FSDP2 trainer ranks (one trainer step first, so the weights are
not the checkpoint's), 2 torch engine replicas, one node. Per rank count: one untimed version
that forms the groups, then `--runs` timed versions per path; a version is timed until both
replicas report they serve it. Sharded: each rank's peak resident memory above where it
started during its send (the kernel's VmHWM, reset before the send) against its bound, its
shard in the engines' dtype + one bucket (rl360.weights.sizing.rank_peak per rank): the bench
fails when a rank exceeds it by more than 10%. Full gather: the ranks gather (the step every
sync needs on that path), rank 0 broadcasts; rank 0's peak above where it started, over the
gather and the send. The replicas' per-tensor checksums after the two paths must be equal.
Last line:
{"bench": "weight_sync_sharded", "ranks": {"2": {"sharded_s", "full_s", "speedup",
 "rank_peak_mb", "rank_bound_mb", "full_rank0_peak_mb", ...}, ...}, ...}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

MODEL = "tiny:sync100m"
REPLICAS = 2


def _samples() -> list[Any]:
    from rl360.types import TrainSample

    return [TrainSample(tokens=[5 + i, 17, 40 + i, 9, 33, 61, 7, 8], mask=[0, 0, 1, 1, 1, 1, 1, 1],
                        sampling_logprobs=[0.0, 0.0] + [-5.5] * 6, advantage=(-1.0) ** i,
                        versions=[-1, -1] + [0] * 6) for i in range(4)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def one_world(serving: Any, ranks: int, args: argparse.Namespace, version: int
              ) -> tuple[dict[str, Any], int]:
    import ray

    from rl360.actors.trainer_group import TrainerGroup
    from rl360.policies.loading import resolve_model_path
    from rl360.recipe import CollectiveSync, TrainerSection
    from rl360.types import Batch
    from rl360.weights.sender_calls import Gather, Rss
    from rl360.weights.shard_transport import ShardedTransport
    from rl360.weights.sizing import rank_peak
    from rl360.weights.transports import CollectiveTransport

    pub = serving.publisher
    cfg = TrainerSection(backend="fsdp", workers=ranks, num_cpus=0, lr=1e-3, micro_batch_size=4)
    trainer = TrainerGroup(cfg, resolve_model_path(MODEL), sharded_sync=True)
    try:
        trainer.train_step(Batch(samples=_samples(), step=0))
        opts = CollectiveSync(sharded=True, bucket_mb=args.bucket_mb, checksum=False,
                              timeout_s=300.0, timeout_min_s=120.0)
        sharded = ShardedTransport(serving, trainer, REPLICAS, opts, dtype="bfloat16")
        times: list[float] = []
        peaks: dict[int, list[float]] = {}
        bounds: dict[int, float] = {}
        for run in range(1 + args.runs):
            version += 1
            t0 = time.perf_counter()
            assert sharded.publish(version), f"sharded version {version} refused"
            dt = time.perf_counter() - t0
            if run == 0:
                continue  # formed the groups
            times.append(dt)
            for r in sharded.last["ranks"]:
                shard = float(r["bytes"])  # this rank's part in the engines' dtype
                bounds[r["rank"]] = rank_peak(shard, 1, sharded.plan.bucket_bytes)
                if r["peak_extra_bytes"] is not None:
                    peaks.setdefault(r["rank"], []).append(float(r["peak_extra_bytes"]))
        plan = sharded.plan
        with_sums = CollectiveSync(sharded=True, bucket_mb=args.bucket_mb, checksum=True,
                                   timeout_s=300.0, timeout_min_s=120.0)
        sharded.options = with_sums  # one more version, with the replicas' checksums
        version += 1
        assert sharded.publish(version)
        assert all(r.ok for r in sharded.last_reports), [r.summary() for r in sharded.last_reports]
        sums_sharded = ray.get(pub.wait_checksums.remote(version, REPLICAS, 120.0))

        # the full-gather path: every rank gathers (each sync's share of the train step on that
        # path), rank 0 broadcasts the gathered fp32 weights over the flat gloo group
        full = CollectiveTransport(serving, trainer.workers[0], REPLICAS,
                                   options=CollectiveSync(checksum=False))
        rank0 = trainer.workers[0]
        full_times, gather_times, full_peaks = [], [], []
        for run in range(1 + args.runs):
            version += 1
            ray.get(rank0.weights.remote(Rss(reset=True)))
            base = ray.get(rank0.weights.remote(Rss()))["rss"]
            t0 = time.perf_counter()
            ray.get([w.weights.remote(Gather()) for w in trainer.workers])
            t1 = time.perf_counter()
            assert full.publish(version)
            got = ray.get(pub.wait_applied.remote(version, REPLICAS, 300.0))
            assert got >= version, f"replicas serve {got}, expected {version}"
            t2 = time.perf_counter()
            if run == 0:
                continue  # formed the gloo group, allocated its flat buffers
            gather_times.append(t1 - t0)
            full_times.append(t2 - t0)
            full_peaks.append(float(ray.get(rank0.weights.remote(Rss()))["peak"] - base))
        full.options = CollectiveSync(checksum=True)
        version += 1
        ray.get([w.weights.remote(Gather()) for w in trainer.workers])
        assert full.publish(version)
        sums_full = ray.get(pub.wait_checksums.remote(version, REPLICAS, 120.0))
        same = all(sums_sharded[r]["sums"] == sums_full[r]["sums"] for r in sums_full)
    finally:
        trainer.shutdown()
    rank_peak_mb = {r: max(v) / 1e6 for r, v in peaks.items()}
    bound_mb = {r: b / 1e6 for r, b in bounds.items()}
    over = {r: rank_peak_mb[r] / bound_mb[r] for r in rank_peak_mb}
    out = {"sharded_s": _median(times), "sharded_spread_s": [min(times), max(times)],
           "full_s": _median(full_times), "full_gather_s": _median(gather_times),
           "speedup": _median(full_times) / _median(times),
           "version_mb": plan.nbytes / 1e6, "buckets": sum(len(b) for b in plan.ranks),
           "bucket_mb": plan.bucket_bytes / 1e6,
           "rank_peak_mb": {str(r): round(v, 2) for r, v in sorted(rank_peak_mb.items())},
           "rank_bound_mb": {str(r): round(v, 2) for r, v in sorted(bound_mb.items())},
           "worst_peak_over_bound": max(over.values()) if over else None,
           "full_rank0_peak_mb": max(full_peaks) / 1e6 if full_peaks else None,
           "bit_identical": same}
    return out, version


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=8.0)
    args = ap.parse_args()

    from rl360.launch.serve_app import start_serving, stop_serving
    from rl360.ray_session import ray_session
    from rl360.recipe import apply_overrides, decode_recipe

    print(f"workload: {MODEL} (113 MB fp32 in the trainer, bf16 engines), FSDP2 ranks "
          f"{args.ranks}, {REPLICAS} torch engine replicas on one node, buckets of "
          f"{args.bucket_mb:g} MB; 1 untimed + {args.runs} timed versions per path; "
          f"load {open('/proc/loadavg').read().split()[:3]}", flush=True)
    recipe = decode_recipe(apply_overrides({}, [
        f"model.path='{MODEL}'", "model.dtype='bfloat16'", f"engine.replicas={REPLICAS}",
        "engine.num_cpus=0.5"]))
    results: dict[str, Any] = {}
    failed = []
    with ray_session(num_cpus=2, dashboard=False, namespace="rl360-bench"):
        for ranks in args.ranks:
            # fresh replicas per rank count: the flat gloo group of the full-gather path is
            # formed once per replica and never again
            serving = start_serving(recipe)
            try:
                res, _ = one_world(serving, ranks, args, 0)
            finally:
                stop_serving(serving)
            results[str(ranks)] = res
            print(f"{ranks} ranks: sharded {res['sharded_s'] * 1e3:.0f} ms a version "
                  f"({res['sharded_spread_s'][0] * 1e3:.0f}-"
                  f"{res['sharded_spread_s'][1] * 1e3:.0f}), full gather "
                  f"{res['full_s'] * 1e3:.0f} ms (gather {res['full_gather_s'] * 1e3:.0f}) "
                  f"-> {res['speedup']:.2f}x; {res['version_mb']:.0f} MB a version in "
                  f"{res['buckets']} buckets; rank peak MB {res['rank_peak_mb']} against "
                  f"bound {res['rank_bound_mb']}; full gather rank 0 peak "
                  f"{res['full_rank0_peak_mb']:.0f} MB; replicas bit-identical "
                  f"{res['bit_identical']}", flush=True)
            worst = res["worst_peak_over_bound"]
            if worst is not None and worst > 1.10:
                failed.append(f"{ranks} ranks: a rank's peak is {worst:.2f}x its bound")
            if not res["bit_identical"]:
                failed.append(f"{ranks} ranks: replicas differ after the two paths")
    load = [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    print(f"load average: {load} (2 shared cores: times are noisy)")
    print(json.dumps({"bench": "weight_sync_sharded", "model": MODEL, "replicas": REPLICAS,
                      "bucket_mb": args.bucket_mb, "runs": args.runs, "ranks": results,
                      "ok": not failed, "loadavg": load}))
    if failed:
        raise SystemExit("; ".join(failed))


if __name__ == "__main__":
    main()
