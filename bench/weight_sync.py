"""Weight sync: publish a ~100 MB state dict to 2 torch engine replicas and time it until both
serve the new version, for each transport: the object store with full versions copied into
each replica's parameters (`zero_copy = false`), full versions served in place out of a fresh
object-store object each (`slots = 0`), full versions written into a weight slot and served
in place (the default: shared memory the sender maps once and rewrites, parameters become
views of it), the object store with delta versions, and the gloo collective.

    .venv/bin/python bench/weight_sync.py [--runs 3] [--changed 0.01]

Workload: tiny:sync100m (fp32, 102 MB), 2 engine replicas on one node. Full versions change
every element; delta versions change a random `--changed` fraction of the elements (what a
bf16 RL step leaves: ~1%). Each transport gets `--warmup` untimed versions, then `--runs`
timed versions: median and spread (min-max). A version is timed from the publish call until
the publisher has both replicas' applied reports (waited for from the start, as the rollout
controller does: with weight slots a replica asleep on the hinted slot serves the version
before the publisher has answered the sender). The stand-in sender is started as trainer rank 0
is (slots.writer_env). Effective GB/s = state bytes / seconds until
every replica applied the version (so a delta that moves fewer bytes counts the whole state);
"moved" = bytes each replica fetched or received for that version. Baseline: one local memcpy
of the same bytes, sampled before every timed version (median). Each transport also prints
where a version's time goes (median ms): the sender's pack (diff, checksums) and put (the
object store write) or send (flatten + gloo broadcast), with their CPU time; the slower
replica's fetch (zero-copy get, or receiving the broadcast) and update (queueing for the
engine loop + the in-place load: apply, with its CPU time); rest = RPC hops and scheduling.
With `--lora [RANK]` (default 16) the workload is SmolLM2-135M-Instruct in fp32 instead and
the transports are full versions (object store, the default slots; gloo) against adapter
versions of a rank-RANK LoRA on its q/k/v/o/gate/up/down projections (trainer.lora: the
sender in adapter mode, the replicas wrapping those projections at the first adapter version
and loading each version's A and B after it): bytes a replica fetches per version and seconds
per version, full against adapter, and their ratios. Last line then:
{"bench": "weight_sync_lora", "ours": <adapter s/version>, "baseline": <full s/version>,
 "ratio": ..., "bytes_ratio": <full bytes / adapter bytes>, ...}

Last line (without --lora):
{"bench": "weight_sync", "ours": <object store full GB/s>, "baseline": <memcpy GB/s>,
 "ratio": ..., "gloo_ratio": ..., "delta_ratio": ..., "copy_ratio": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


class StateSender:
    """Stands in for the trainer's rank 0 (rl360.actors.trainer_group.TrainerWorker): holds a
    state dict and sends it through the same code (rl360.weights.sender.WeightSender)."""

    def __init__(self, model_dir: str, lora_rank: int = 0) -> None:
        """`lora_rank` > 0: the sender is in adapter mode (trainer.lora), its state a LoRA
        adapter of that rank on the model's 7 attention and MLP projections (B not zero, so
        the engines' outputs change)."""
        import torch
        from safetensors.torch import load_file

        self.state = load_file(f"{model_dir}/model.safetensors")
        self.adapter: Any = None
        if lora_rank:
            from rl360.policies.lora import LoraSpec
            from rl360.recipe import LORA_TARGETS

            self.adapter = LoraSpec(lora_rank, 2.0 * lora_rank, 0.0, LORA_TARGETS)
            g = torch.Generator().manual_seed(0)
            lora = {}
            for k, v in self.state.items():
                if k.endswith(".weight") and ".layers." in k and v.dim() == 2 and \
                        k.split(".")[-2] in LORA_TARGETS:
                    mod = k.removesuffix(".weight")
                    lora[f"{mod}.lora_A.weight"] = torch.randn(lora_rank, v.shape[1],
                                                               generator=g) * 0.01
                    lora[f"{mod}.lora_B.weight"] = torch.randn(v.shape[0], lora_rank,
                                                               generator=g) * 0.01
            self.state = lora
        self.group: Any = None  # the WeightSender of the gloo transport
        self.senders: dict[str, Any] = {}  # the object store's, per packer's settings
        self.gen = torch.Generator().manual_seed(0)

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.state.values())

    def bump(self, changed: float) -> float:
        """An optimizer step: every element moves (changed=1), or a random fraction of them
        (the rest stay bit-identical). Returns the fraction of elements changed."""
        import torch

        total = hit = 0
        for v in self.state.values():
            if changed >= 1.0:
                v.add_(1e-3)
                hit += v.numel()
            else:
                k = max(1, int(v.numel() * changed))
                idx = torch.randint(0, v.numel(), (k,), generator=self.gen)
                v.view(-1)[idx] += 1e-3
                hit += int(idx.unique().numel())
            total += v.numel()
        return hit / total

    def weights(self, call: Any) -> Any:
        """Run a transport's weight sender call (rl360.weights.sender) on a WeightSender over
        this state dict: one per packer's settings (each transport here has its own), and the
        time a gloo send takes."""
        from rl360.weights.sender import WeightSender
        from rl360.weights.sender_calls import Pack, Send

        if isinstance(call, Pack):
            key = json.dumps(call.packer, sort_keys=True)
            return self.senders.setdefault(
                key, WeightSender(lambda: self.state, adapter=self.adapter)).handle(call)
        if self.group is None:
            self.group = WeightSender(lambda: self.state, adapter=self.adapter)
        t0, c0 = time.perf_counter(), time.process_time()
        out = self.group.handle(call)
        if isinstance(call, Send):
            self.sent = {"send_s": time.perf_counter() - t0,
                         "send_cpu_s": time.process_time() - c0}
        return out

    def last_send(self) -> dict[str, float]:
        return dict(getattr(self, "sent", {}))


class Memcpy:
    """The baseline: one local copy of the same bytes (buffers already touched), sampled next
    to every timed version so both see the same load on a shared box."""

    def __init__(self, nbytes: int) -> None:
        import torch

        self.nbytes = nbytes
        self.src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
        self.dst = torch.empty_like(self.src).fill_(0.0)
        self.samples: list[float] = []

    def sample(self) -> None:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        self.samples.append(self.nbytes / (time.perf_counter() - t0) / 1e9)


class Served:
    """When the replicas' applied reports came back (a thread waits on the ref, so the time is
    not the moment the driver's own publish call returned)."""

    def __init__(self, ref: Any) -> None:
        import threading

        import ray

        self.value: Any = None
        self.at = 0.0

        def wait() -> None:
            self.value = ray.get(ref)
            self.at = time.perf_counter()

        self.thread = threading.Thread(target=wait, name="weight-sync-served", daemon=True)
        self.thread.start()

    def result(self, t0: float) -> tuple[Any, float]:
        self.thread.join()
        return self.value, self.at - t0


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


# where a version's time goes: the sender's part (object store: pack = diff + checksums,
# put = the object store write; gloo: send = flatten + broadcast), then per replica fetch
# (object store: the zero-copy get; gloo: receiving the broadcast) and update (queueing for
# the engine loop + the in-place load, of which apply is the load itself, with its CPU time)
PARTS = ("pack_s", "pack_cpu_s", "put_s", "put_cpu_s", "send_s", "send_cpu_s")
REPLICA_PARTS = ("fetch_s", "update_s", "apply_s", "apply_cpu_s")


def breakdown(sender: dict[str, Any], replicas: dict[str, dict[str, Any]], total: float,
              version: int) -> dict[str, float]:
    """Milliseconds per part of one version; replica parts are the slower replica's, `rest` is
    what no part accounts for (RPC hops to the sender, publisher and back, scheduling)."""
    mine = [d for d in replicas.values() if d.get("version") == version]
    out = {k.removesuffix("_s"): 1e3 * float(sender[k]) for k in PARTS if k in sender}
    for k in REPLICA_PARTS:
        if mine and all(k in d for d in mine):
            out[k.removesuffix("_s")] = 1e3 * max(float(d[k]) for d in mine)
    sender_s = sum(float(sender.get(k, 0.0)) for k in ("pack_s", "put_s", "send_s"))
    slowest = max((float(d.get("fetch_s", 0)) + float(d.get("update_s", 0)) for d in mine),
                  default=0.0)
    out["rest"] = 1e3 * max(0.0, total - sender_s - slowest)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4,
                    help="untimed versions per transport first (the object store allocator "
                         "alternates between two regions: the version out and the new one; "
                         "the sender makes its 3 weight slots in the first 3 versions)")
    ap.add_argument("--changed", type=float, default=0.01,
                    help="fraction of elements a delta version changes")
    ap.add_argument("--lora", type=int, nargs="?", const=16, default=0, metavar="RANK",
                    help="SmolLM2: full versions against adapter versions of this rank")
    args = ap.parse_args()
    if args.lora:
        lora_main(args)
        return

    import ray

    from rl360.launch.serve_app import start_serving, stop_serving
    from rl360.policies.loading import resolve_model_path
    from rl360.ray_session import ray_session
    from rl360.recipe import ObjectStoreSync, apply_overrides, decode_recipe
    from rl360.weights.slots import writer_env
    from rl360.weights.transports import CollectiveTransport, ObjectStoreTransport

    model_dir = str(resolve_model_path("tiny:sync100m"))
    recipe = decode_recipe(apply_overrides({}, [
        "model.path='tiny:sync100m'", "engine.replicas=2", "engine.num_cpus=0.5"]))
    results: dict[str, dict[str, Any]] = {}
    with ray_session(num_cpus=2, dashboard=False, namespace="rl360-bench"):
        serving = start_serving(recipe)
        try:
            # started as the trainer's rank 0 is (rl360.launch.train_run.trainer_rank_options)
            sender = ray.remote(StateSender).options(
                num_cpus=0, runtime_env={"env_vars": writer_env()}).remote(model_dir)
            nbytes = ray.get(sender.nbytes.remote())
            print(f"workload: tiny:sync100m, {nbytes / 1e6:.0f} MB fp32 state dict -> 2 torch "
                  f"engine replicas on one node; {args.warmup} warm-up + {args.runs} timed versions per "
                  f"transport; delta versions change {args.changed:.1%} of the elements")
            version = 0
            memcpy = Memcpy(nbytes)
            transports = {
                # zero_copy off: each replica copies the version into its own parameters
                "object_store_copy": (ObjectStoreTransport(
                    serving, sender, ObjectStoreSync(zero_copy=False)), 1.0),
                # served in place out of a fresh object-store object per version (slots off)
                "object_store_put": (ObjectStoreTransport(
                    serving, sender, ObjectStoreSync(slots=0)), 1.0),
                # the default: written into a weight slot, served in place (pointer swap)
                "object_store": (ObjectStoreTransport(serving, sender, ObjectStoreSync()), 1.0),
                "object_store_delta": (ObjectStoreTransport(
                    serving, sender, ObjectStoreSync(delta=True)), args.changed),
                "gloo": (CollectiveTransport(serving, sender, replicas=2), 1.0),
            }
            for name, (transport, changed) in transports.items():
                times, moved, kinds, fractions, watched = [], [], [], [], []
                parts: list[dict[str, float]] = []
                for run in range(args.warmup + args.runs):
                    fractions.append(ray.get(sender.bump.remote(changed)))
                    version += 1
                    if run >= args.warmup:
                        memcpy.sample()
                    t0 = time.perf_counter()
                    # timed until both replicas serve it, watched from the start as the rollout
                    # controller does: a replica that slept on the version's slot serves it
                    # before the publisher has answered the sender
                    served = Served(serving.publisher.wait_applied.remote(version, 2, 300.0))
                    assert transport.publish(version), f"{name}: version {version} refused"
                    got, dt = served.result(t0)
                    assert got >= version, f"replicas serve {got}, expected {version}"
                    last = getattr(transport, "last", {}) or {"kind": "full", "nbytes": nbytes}
                    if run >= args.warmup:
                        times.append(dt)
                        moved.append(int(last["nbytes"]))
                        kinds.append(last["kind"])
                        sent = last if "put_s" in last else ray.get(sender.last_send.remote())
                        fetched = ray.get(serving.publisher.status.remote())["fetched"]
                        parts.append(breakdown(sent, fetched, dt, version))
                        watched.append(sum(bool(d.get("watched")) for d in fetched.values()))
                gbps = [nbytes / t / 1e9 for t in times]
                wire = [m / t / 1e9 for m, t in zip(moved, times, strict=True)]
                results[name] = {"seconds": stats(times), "gbps": stats(gbps),
                                 "moved_mb": statistics.median(moved) / 1e6,
                                 "wire_gbps": statistics.median(wire), "kinds": kinds,
                                 "changed": statistics.median(fractions[args.warmup:]),
                                 # replica loads that slept on the hinted slot (of 2 a version)
                                 "watched": sum(watched),
                                 "breakdown_ms": {k: round(statistics.median(p.get(k, 0.0)
                                                                             for p in parts), 1)
                                                  for k in parts[0]}}
                s, g = results[name]["seconds"], results[name]["gbps"]
                print(f"{name:>18}: {s['median'] * 1e3:7.1f} ms median "
                      f"({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f}), {g['median']:.2f} GB/s "
                      f"effective ({g['min']:.2f}-{g['max']:.2f}); moved "
                      f"{results[name]['moved_mb']:.1f} MB per replica per version "
                      f"({results[name]['wire_gbps']:.2f} GB/s); versions {kinds}; "
                      f"loads off a hinted slot {sum(watched)}/{2 * len(times)}", flush=True)
                print(f"{'':>18}  median ms: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in results[name]["breakdown_ms"].items()), flush=True)
        finally:
            stop_serving(serving)
    base = stats(memcpy.samples)
    print(f"{'memcpy':>18}: {base['median']:.2f} GB/s median ({base['min']:.2f}-"
          f"{base['max']:.2f})")
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"load average: {' '.join(load)} (2 shared cores: figures are noisy)")
    ratio = {k: v["gbps"]["median"] / base["median"] for k, v in results.items()}
    print(json.dumps({
        "bench": "weight_sync", "ours": round(results["object_store"]["gbps"]["median"], 3),
        "baseline": round(base["median"], 3), "ratio": round(ratio["object_store"], 4),
        "gloo_ratio": round(ratio["gloo"], 4), "delta_ratio": round(ratio["object_store_delta"], 4),
        "copy_ratio": round(ratio["object_store_copy"], 4),
        "put_ratio": round(ratio["object_store_put"], 4),
        **{f"{k}_gbps": round(v["gbps"]["median"], 3) for k, v in results.items()},
        **{f"{k}_spread_gbps": [round(v["gbps"]["min"], 3), round(v["gbps"]["max"], 3)]
           for k, v in results.items()},
        **{f"{k}_moved_mb": round(v["moved_mb"], 2) for k, v in results.items()},
        **{f"{k}_breakdown_ms": v["breakdown_ms"] for k, v in results.items()},
        "state_mb": round(nbytes / 1e6, 1), "replicas": 2, "runs": args.runs,
        "loadavg": [float(x) for x in load]}))


def lora_main(args: argparse.Namespace) -> None:
    """--lora: full versions against adapter versions on SmolLM2 (see the module docstring)."""
    import ray

    from rl360.launch.serve_app import start_serving, stop_serving
    from rl360.policies.loading import resolve_model_path
    from rl360.ray_session import ray_session
    from rl360.recipe import apply_overrides, decode_recipe
    from rl360.weights.slots import writer_env

    model_dir = str(resolve_model_path("smollm2"))
    recipe = decode_recipe(apply_overrides({}, [
        "model.path='smollm2'", "engine.replicas=2", "engine.num_cpus=0.5"]))
    results: dict[str, dict[str, Any]] = {}
    with ray_session(num_cpus=2, dashboard=False, namespace="rl360-bench"):
        opts = {"num_cpus": 0, "runtime_env": {"env_vars": writer_env()}}
        senders = {"full": ray.remote(StateSender).options(**opts).remote(model_dir),
                   "lora": ray.remote(StateSender).options(**opts).remote(model_dir, args.lora)}
        sizes = {k: ray.get(v.nbytes.remote()) for k, v in senders.items()}
        print(f"workload: SmolLM2-135M-Instruct fp32, {sizes['full'] / 1e6:.1f} MB of weights; "
              f"a rank-{args.lora} adapter on q/k/v/o/gate/up/down: {sizes['lora'] / 1e6:.1f} "
              f"MB; 2 torch engine replicas on one node; {args.warmup} warm-up + {args.runs} "
              "timed versions per transport; the Serve app is started afresh for the adapter "
              "transports (a replica joins one gloo group)", flush=True)
        for kind in ("full", "lora"):
            serving = start_serving(recipe)
            try:
                _lora_phase(args, serving, senders[kind], kind, sizes[kind], results)
            finally:
                stop_serving(serving)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    med = {k: v["seconds"]["median"] for k, v in results.items()}
    bytes_ratio = sizes["full"] / sizes["lora"]
    print(f"bytes per version: full {sizes['full'] / 1e6:.1f} MB, adapter {sizes['lora'] / 1e6:.2f} "
          f"MB: {bytes_ratio:.1f}x fewer")
    for t in ("object_store", "gloo"):
        print(f"{t}: adapter {med[t + '_lora'] * 1e3:.1f} ms a version against full "
              f"{med[t + '_full'] * 1e3:.1f} ms ({med[t + '_lora'] / med[t + '_full']:.3f} x)")
    print(f"load average: {' '.join(load)} (2 shared cores: figures are noisy)")
    print(json.dumps({
        "bench": "weight_sync_lora", "ours": round(med["object_store_lora"], 4),
        "baseline": round(med["object_store_full"], 4),
        "ratio": round(med["object_store_lora"] / med["object_store_full"], 4),
        "gloo_ratio": round(med["gloo_lora"] / med["gloo_full"], 4),
        "bytes_ratio": round(bytes_ratio, 2), "rank": args.lora,
        "full_mb": round(sizes["full"] / 1e6, 2), "adapter_mb": round(sizes["lora"] / 1e6, 2),
        **{f"{k}_s": v["seconds"] for k, v in results.items()},
        "replicas": 2, "runs": args.runs, "loadavg": [float(x) for x in load]}))


def _lora_phase(args: argparse.Namespace, serving: Any, sender: Any, kind: str, nbytes: int,
                results: dict[str, dict[str, Any]]) -> None:
    """Time `kind` ("full" or "lora") versions over the object store, then gloo."""
    import ray

    from rl360.recipe import ObjectStoreSync
    from rl360.weights.transports import CollectiveTransport, ObjectStoreTransport

    transports = {f"object_store_{kind}": ObjectStoreTransport(serving, sender, ObjectStoreSync()),
                  f"gloo_{kind}": CollectiveTransport(serving, sender, replicas=2)}
    version = 0
    for name, transport in transports.items():
        times, moved = [], []
        for run in range(args.warmup + args.runs):
            ray.get(sender.bump.remote(1.0))
            version += 1
            t0 = time.perf_counter()
            served = Served(serving.publisher.wait_applied.remote(version, 2, 600.0))
            assert transport.publish(version), f"{name}: version {version} refused"
            got, dt = served.result(t0)
            assert got >= version, f"replicas serve {got}, expected {version}"
            if run >= args.warmup:
                times.append(dt)
                last = getattr(transport, "last", {}) or {}
                moved.append(int(last.get("nbytes", nbytes)))
        results[name] = {"seconds": stats(times), "moved_mb": statistics.median(moved) / 1e6}
        sec = results[name]["seconds"]
        print(f"{name:>18}: {sec['median'] * 1e3:8.1f} ms median ({sec['min'] * 1e3:.1f}-"
              f"{sec['max'] * 1e3:.1f}); moved {results[name]['moved_mb']:.2f} MB per "
              "replica per version", flush=True)


if __name__ == "__main__":
    main()
