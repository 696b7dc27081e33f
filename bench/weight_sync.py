"""Weight sync: publish a >= 100 MB state dict to 2 engine replicas through each transport
(object store; gloo collective) and time it until both replicas serve the new version.

    .venv/bin/python bench/weight_sync.py [--rounds 3]

Effective GB/s = state bytes / seconds until every replica applied it. The baseline is a
local memcpy of the same bytes. Last line:
{"bench": "weight_sync", "ours": <best transport GB/s>, "baseline": <memcpy GB/s>, "ratio": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


class StateSender:
    """Stands in for the trainer's rank 0: holds a state dict, sends it either way."""

    def __init__(self, model_dir: str) -> None:
        from safetensors.torch import load_file

        self.state = load_file(f"{model_dir}/model.safetensors")
        self.group = None

    def bump(self) -> int:
        for v in self.state.values():
            v.add_(1e-3)
        return sum(v.numel() * v.element_size() for v in self.state.values())

    def state_dict(self):  # type: ignore[no-untyped-def]
        return self.state

    def weight_spec(self):  # type: ignore[no-untyped-def]
        from rl360.serve.weights.transports import tensor_spec

        return tensor_spec(self.state)

    def open_group(self, host: str, port: int, world: int) -> None:
        from rl360.serve.weights.transports import GlooGroup

        self.group = GlooGroup(host, port, 0, world)

    def send_weights(self) -> None:
        self.group.send(self.state)  # type: ignore[union-attr]


def memcpy_gbps(nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import ray

    from rl360.launch.serve_app import start_serving, stop_serving
    from rl360.policies.loading import resolve_model_path
    from rl360.ray_session import ray_session
    from rl360.recipe import apply_overrides, decode_recipe
    from rl360.serve.weights.transports import CollectiveTransport

    model_dir = str(resolve_model_path("tiny:sync100m"))
    recipe = decode_recipe(apply_overrides({}, [
        "model.path='tiny:sync100m'", "engine.replicas=2", "engine.num_cpus=0.5"]))
    results: dict[str, float] = {}
    with ray_session(num_cpus=2, dashboard=False, namespace="rl360-bench"):
        serving = start_serving(recipe)
        try:
            sender = ray.remote(StateSender).options(num_cpus=0).remote(model_dir)
            nbytes = ray.get(sender.bump.remote())
            print(f"state dict: {nbytes / 1e6:.0f} MB, 2 engine replicas")
            version = 0
            collective = CollectiveTransport(serving, sender, replicas=2)
            for name in ("object_store", "collective"):
                times = []
                for _ in range(args.rounds):
                    ray.get(sender.bump.remote())
                    version += 1
                    t0 = time.perf_counter()
                    if name == "object_store":
                        serving.publish_ref(version, sender.state_dict.remote())
                    else:
                        collective.publish(version)
                    got = ray.get(serving.publisher.wait_applied.remote(version, 2, 300.0))
                    assert got >= version, f"replicas serve {got}, expected {version}"
                    times.append(time.perf_counter() - t0)
                best = min(times)
                results[name] = nbytes / best / 1e9
                print(f"{name:>12}: {best:.3f}s best of {args.rounds} "
                      f"({results[name]:.2f} GB/s effective per replica set)", flush=True)
        finally:
            stop_serving(serving)
    base = memcpy_gbps(nbytes)
    print(f"{'memcpy':>12}: {base:.2f} GB/s")
    best_name = max(results, key=results.get)  # type: ignore[arg-type]
    print(json.dumps({"bench": "weight_sync", "ours": round(results[best_name], 3),
                      "baseline": round(base, 3), "ratio": round(results[best_name] / base, 4),
                      "transport": best_name,
                      **{f"{k}_gbps": round(v, 3) for k, v in results.items()}}))


if __name__ == "__main__":
    main()
