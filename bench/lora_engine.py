"""How the torch engine should serve base + adapter: the low-rank path (each target projection
runs x W^T + s (x A^T) B^T every step) against merging each adapter version into the weights
(W = W0 + s B A once per version, then plain projections).

    .venv/bin/python bench/lora_engine.py [--model smollm2] [--rank 16] [--threads 2] [--runs 3]

Workload: `--model` (default SmolLM2-135M-Instruct) in fp32 on our own Llama modules, the
engine's runner (serve/engines/torch_model.LlamaRunner) over its slot KV cache: per batch size
in `--rows`, the rows prefilled with `--prompt`-token prompts (64), then `--steps` decode steps
timed (ms a step), once with plain projections and once with rank-`--rank` adapters (alpha 2 x
rank) on q/k/v/o/gate/up/down; also a 4 x `--prompt` prefill. Per version: the low-rank path copies the
adapter tensors into its A and B; the merged path recomputes W0 + s B A for every target (W0
kept: the adapted weights once more in memory). Median of `--runs` runs each (first run a
warm-up), in CPU milliseconds of this process (`--clock wall`: wall). Last line: {"bench": "lora_engine", "decode_ms": {...}, "version_ms": {...}, ...}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from rl360.policies.lora import LoraSpec, add_lora, lora_modules
from rl360.recipe import LORA_TARGETS

CLOCK = time.process_time  # CPU seconds of this process (--clock wall: time.perf_counter)


def timed(fn: Any, runs: int) -> float:
    xs = []
    for i in range(runs + 1):
        t = CLOCK()
        fn()
        if i:
            xs.append(CLOCK() - t)
    return statistics.median(xs)


def decode_ms(runner: Any, rows: int, steps: int, runs: int, length: int) -> float:
    prompt = [[(7 * r + i) % 1000 + 3 for i in range(length)] for r in range(rows)]
    runner.kv.release()
    runner.forward(0, prompt, [0] * rows)
    pos = [length]

    def run() -> None:
        for _ in range(steps):
            runner.forward(0, [[5]] * rows, [pos[0]] * rows)
            pos[0] += 1

    return timed(run, runs) / steps * 1e3


def main() -> None:
    from rl360.policies.loading import resolve_model_path
    from rl360.policies.native_llama import load_native_llama, native_config
    from rl360.serve.engines.torch_model import LlamaRunner

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens each row decodes after")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="CPU seconds of this process (default: what holds on a shared box) or "
                         "wall seconds")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    cfg = native_config(path)
    if cfg is None:
        raise SystemExit(f"{args.model}: not a plain Llama checkpoint")
    plain = load_native_llama(path, cfg, torch.float32, torch.device("cpu"))
    adapted = load_native_llama(path, cfg, torch.float32, torch.device("cpu"))
    spec = LoraSpec(rank=args.rank, alpha=2.0 * args.rank, targets=LORA_TARGETS)
    add_lora(adapted, spec)
    gen = torch.Generator().manual_seed(0)
    mods = lora_modules(adapted)
    with torch.no_grad():
        for m in mods.values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 1e-3)
    adapter = {f"{n}.{p}": getattr(m, p).weight.detach().clone()
               for n, m in mods.items() for p in ("lora_A", "lora_B")}
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    base = {n: m.weight.detach().clone() for n, m in mods.items()}  # W0 of the merged path
    base_bytes = sum(t.numel() * t.element_size() for t in base.values())
    targets = {n: dict(plain.named_modules())[n] for n in mods}
    runners = {"plain": LlamaRunner(plain), "low-rank": LlamaRunner(adapted)}
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    print(f"model {args.model}, fp32, {args.threads} thread(s); rank {args.rank} on "
          f"{len(LORA_TARGETS)} projections x {cfg.num_hidden_layers} layers: adapter "
          f"{adapter_bytes / 2**20:.1f} MiB, the merged path keeps W0 {base_bytes / 2**20:.0f} MiB; "
          f"{args.runs} runs + 1 warm-up; load {' '.join(load_before)}", flush=True)
    out: dict[str, dict[str, float]] = {}
    for rows in (int(x) for x in args.rows.split(",")):
        for name, runner in runners.items():
            out.setdefault(name, {})[str(rows)] = decode_ms(runner, rows, args.steps, args.runs,
                                                            args.prompt)
        p, lr = out["plain"][str(rows)], out["low-rank"][str(rows)]
        print(f"decode {rows:3d} rows: plain (= merged) {p:7.2f} ms a step, low-rank {lr:7.2f} "
              f"ms ({lr / p:.3f} x)", flush=True)
    prefill = {}
    for name, runner in runners.items():
        prompt = [[(11 * r + i) % 1000 + 3 for i in range(args.prompt)] for r in range(4)]

        def run(runner: Any = runner, prompt: list[list[int]] = prompt) -> None:
            runner.kv.release()
            runner.forward(0, prompt, [0] * 4)

        prefill[name] = timed(run, args.runs) * 1e3
    print(f"prefill 4 x {args.prompt}: plain {prefill['plain']:.1f} ms, low-rank {prefill['low-rank']:.1f} "
          f"ms ({prefill['low-rank'] / prefill['plain']:.3f} x)")

    def load_low_rank() -> None:
        with torch.no_grad():
            for n, m in mods.items():
                m.lora_A.weight.copy_(adapter[f"{n}.lora_A"])
                m.lora_B.weight.copy_(adapter[f"{n}.lora_B"])

    def load_merged() -> None:
        with torch.no_grad():
            for n, lin in targets.items():
                a, b = adapter[f"{n}.lora_A"], adapter[f"{n}.lora_B"]
                torch.addmm(base[n], b, a, alpha=spec.scaling, out=lin.weight)

    version = {"low-rank": timed(load_low_rank, args.runs) * 1e3,
               "merged": timed(load_merged, args.runs) * 1e3}
    print(f"a version: low-rank load {version['low-rank']:.1f} ms, merge {version['merged']:.1f} ms")
    print(json.dumps({"bench": "lora_engine", "model": args.model, "rank": args.rank,
                      "clock": args.clock,
                      "threads": args.threads, "decode_ms": out, "prefill_ms": prefill,
                      "version_ms": version, "adapter_bytes": adapter_bytes,
                      "merged_extra_bytes": base_bytes, "load": load_before}))


if __name__ == "__main__":
    main()
