"""The GPU checks behind tests/gpu/run.sh (and tests/gpu/test_*.py), one subcommand each. Every
model is built from a config (no downloads); every subcommand takes --dry-run, which checks
imports and argument wiring on any machine and exits 0.

    python tests/gpu/gpu_check.py build-model DIR [--layers 24] [--vocab-size 320]
    python tests/gpu/gpu_check.py parity --engine sglang|vllm --model DIR --out OUT.json
    python tests/gpu/gpu_check.py nccl --out OUT.json
    python tests/gpu/gpu_check.py bench --engine sglang|vllm --model DIR

- build-model: Qwen2-0.5B's transformer shape (hidden 896, 24 layers, 14 heads / 2 KV heads,
  MLP 4864), random weights (seed 0), the tiny byte-level tokenizer; vocab 320 by default so
  every sampled id decodes (--vocab-size 151936 for the full embedding: ~0.5B parameters).
- parity: the torch backend (the reference, float32 on CPU) and the engine (bfloat16 on the
  GPU) decode the same prompts greedily; ids must agree up to a near-tie (where the torch
  model's logprob margin between the two choices is below --tie-tol) and logprobs must be
  within --lp-tol. Then the same perturbed weights go to both through update_weights(1, ...),
  and the check repeats; the outputs must have changed, the same way on both. A second
  update to version 1 must be refused. SGLang: the checksum debug path (get_weights_by_name)
  must find the perturbed tensors on the engine.
- nccl: the bucketed weight broadcast between two processes over NCCL (needs two GPUs; on
  one GPU NCCL refuses two ranks and this is reported, not hidden), and the CUDA IPC path
  (same GPU), both verified by per-tensor checksums.
- bench: tokens/s of the engine's own API (the backend driven directly) and through the
  session server (Ray Serve, HTTP sessions); last line {"bench": ..., "ratio": server/raw}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TEXTS = ["def fibonacci(n):", "Explain what a hash map is.", "The three laws are",
         "import numpy as np\n", "Q: What is 17 * 23?\nA:", "class Stack:\n    def"]

ENGINE_OPTIONS: dict[str, dict[str, Any]] = {
    # a share of the GPU each, so a second engine (bench: raw, then served) fits beside leftovers
    "sglang": {"mem_fraction_static": 0.35, "disable_cuda_graph": True},
    "vllm": {"gpu_memory_utilization": 0.35, "enforce_eager": True},
}
PERTURBED = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.o_proj.weight"]


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- model


def build_model(out: Path, layers: int, vocab_size: int, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rl360.policies.tiny import build_tiny_tokenizer

    if (out / "config.json").is_file():
        return out
    tok = build_tiny_tokenizer()
    if vocab_size < len(tok):
        raise SystemExit(f"--vocab-size {vocab_size} < tokenizer size {len(tok)}")
    cfg = Qwen2Config(
        vocab_size=vocab_size, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, initializer_range=0.02,
        bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id, torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    log(f"built {out}: {n / 1e6:.0f}M parameters, {layers} layers, vocab {vocab_size}")
    return out


def prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(t, add_special_tokens=False) for t in TEXTS]


def perturbation(model_dir: str, seed: int = 1) -> dict[str, Any]:
    """New values for a few tensors (one fused in the engines: q_proj, up_proj)."""
    import torch
    from safetensors import safe_open

    g = torch.Generator().manual_seed(seed)
    out = {}
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        for name in PERTURBED:
            w = f.get_tensor(name).float()
            out[name] = (w + torch.randn(w.shape, generator=g) * w.std() * 3.0).to(torch.bfloat16)
    return out


# ----------------------------------------------------------------------------- parity


async def greedy(backend: Any, ps: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    from rl360.types import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    gens = await asyncio.gather(*(backend.generate(p, sp) for p in ps))
    return [{"ids": g.token_ids, "logprobs": g.logprobs, "version": g.policy_version}
            for g in gens]


def teacher_scores(model: Any, prompt: list[int], ids: list[int]) -> tuple[list[float], list[float]]:
    """Under the torch model: logprob of each of `ids` and of the model's own argmax there."""
    import torch

    with torch.no_grad():
        x = torch.tensor([prompt + ids])
        logp = torch.log_softmax(model(input_ids=x).logits[0, len(prompt) - 1:-1].float(), -1)
    chosen = logp.gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
    return chosen.tolist(), logp.max(-1).values.tolist()


def compare(ref: list[dict[str, Any]], eng: list[dict[str, Any]], model: Any,
            ps: list[list[int]], tie_tol: float) -> dict[str, Any]:
    """Greedy ids equal up to a near-tie; logprob differences on the common prefix."""
    exact, ties, bad, lp_diff = 0, 0, [], 0.0
    for i, (r, e, p) in enumerate(zip(ref, eng, ps, strict=True)):
        n = 0
        while n < min(len(r["ids"]), len(e["ids"])) and r["ids"][n] == e["ids"][n]:
            n += 1
        if n:
            lp_diff = max(lp_diff, max(abs(a - b) for a, b in
                                       zip(r["logprobs"][:n], e["logprobs"][:n], strict=True)))
        if r["ids"] == e["ids"]:
            exact += 1
            continue
        if n >= len(e["ids"]):
            bad.append({"prompt": i, "at": n, "why": "engine stopped early"})
            continue
        chosen, best = teacher_scores(model, p, e["ids"][: n + 1])
        margin = best[n] - chosen[n]  # how much worse the engine's pick is, under torch
        if margin <= tie_tol:
            ties += 1
        else:
            bad.append({"prompt": i, "at": n, "margin": margin})
    return {"exact": exact, "near_ties": ties, "mismatches": bad, "max_lp_diff": lp_diff,
            "prompts": len(ref)}


async def parity(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rl360.recipe import EngineSection, ModelSection
    from rl360.serve.engines.base import build_engine_backend
    from rl360.serve.engines.torch_backend import TorchBackend
    from rl360.weights.payloads import TensorUpdate

    ps = prompts(args.model)
    new = perturbation(args.model)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 2))
    # transformers' modules: `compare` teacher-forces through the HF model's own forward
    ref = TorchBackend(EngineSection(max_batch_size=64, native_llama=False),
                       ModelSection(path=args.model))
    t0 = time.perf_counter()
    eng = build_engine_backend(
        EngineSection(backend=args.engine, max_batch_size=64,
                      options=dict(ENGINE_OPTIONS[args.engine])),
        ModelSection(path=args.model, dtype=args.dtype, max_model_len=2048), seed=0)
    res: dict[str, Any] = {"engine": args.engine, "dtype": args.dtype}
    try:
        e0 = await greedy(eng, ps, args.max_tokens)
        res["engine_start_and_first_s"] = time.perf_counter() - t0
        r0 = await greedy(ref, ps, args.max_tokens)
        res["before"] = compare(r0, e0, ref.model, ps, args.tie_tol)
        res["updated"] = await eng.update_weights(1, TensorUpdate(new))
        res["ref_updated"] = await ref.update_weights(1, TensorUpdate(new))
        res["stale_refused"] = not await eng.update_weights(1, TensorUpdate(new))
        e1 = await greedy(eng, ps, args.max_tokens)
        r1 = await greedy(ref, ps, args.max_tokens)
        res["after"] = compare(r1, e1, ref.model, ps, args.tie_tol)
        res["engine_changed"] = sum(a["ids"] != b["ids"] for a, b in zip(e0, e1, strict=True))
        res["ref_changed"] = sum(a["ids"] != b["ids"] for a, b in zip(r0, r1, strict=True))
        res["versions_after"] = sorted({g["version"] for g in e1})
        if eng.weight_intake().own_group:  # SGLang: checksums read back from the engine
            from rl360.weights.plan import checksum_state, compare_checksums

            sums = (await eng.weight_checksums(PERTURBED, TensorUpdate(new))).sums
            ours = checksum_state(new, {n: v[0] for n, v in sums.items()}, f"torch.{args.dtype}")
            rep = compare_checksums(ours, {n: v[1] for n, v in sums.items()}, version=1,
                                    replica=args.engine)
            res["checksum"] = {"ok": rep.ok, "summary": rep.summary()}
    finally:
        await eng.close()
        await ref.close()
    b, a = res["before"], res["after"]
    res["ok"] = bool(
        not b["mismatches"] and not a["mismatches"] and b["max_lp_diff"] <= args.lp_tol
        and a["max_lp_diff"] <= args.lp_tol and res["updated"] and res["stale_refused"]
        and res["engine_changed"] > 0 and res["versions_after"] == [1]
        and res.get("checksum", {"ok": True})["ok"])
    return res


# ----------------------------------------------------------------------------- nccl / ipc


def _nccl_receiver(port: int, group: str, buckets: Any, device: int, q: Any) -> None:
    import torch

    from rl360.weights.nccl import GroupReceiver
    from rl360.weights.plan import checksum_state

    try:
        torch.cuda.set_device(device)
        rx = GroupReceiver("127.0.0.1", port, 2, 1, "nccl", group, timeout_s=90)
        got = rx.receive(buckets, "per_tensor")
        q.put({"sums": checksum_state({k: v.cpu() for k, v in got.items()})})
        rx.close()
    except Exception as exc:
        q.put({"error": repr(exc)})


def _ipc_receiver(payload: bytes, q: Any) -> None:
    from rl360.weights.nccl import load_ipc
    from rl360.weights.plan import checksum_state

    try:
        got = load_ipc(payload)
        q.put({"sums": checksum_state({k: v.cpu() for k, v in got.items()})})
    except Exception as exc:
        q.put({"error": repr(exc)})


def _shard_sender(rank: int, ranks: int, state: dict[str, Any], bucket_mb: float,
                  q: Any) -> None:
    """One trainer rank of a sharded NCCL sync, on GPU `rank` (rl360.weights.shards)."""
    import torch

    from rl360.weights.shard_groups import ShardSender

    try:
        torch.cuda.set_device(rank)
        held = {k: v.cuda() for k, v in state.items()}
        sender = ShardSender(lambda: held, rank, ranks)
        sender.layout("bfloat16", bucket_mb)
        q.put({"rank": rank, "addr": sender.listen(1, "127.0.0.1", 2, 90.0)})
        q.put({"rank": rank, "sent": sender.send(1, 1, "nccl", 90.0, 90.0, checksum=True)})
        sender.close()
    except Exception as exc:
        q.put({"rank": rank, "error": repr(exc)})


def _shard_receiver(plan: Any, addrs: dict[int, tuple[str, int]], device: int, q: Any) -> None:
    """An engine replica's end of a sharded NCCL sync, on GPU `device`."""
    import torch

    from rl360.weights.plan import checksum_state
    from rl360.weights.shard_groups import ShardReceiver

    try:
        torch.cuda.set_device(device)
        rx = ShardReceiver()
        rx.join(1, addrs, 1, 2, "nccl", 90.0)
        got = rx.receive(plan, 90.0, checksum=True)
        q.put({"sums": checksum_state({k: v.cpu() for k, v in got.items()})})
        rx.close()
    except Exception as exc:
        q.put({"error": repr(exc)})


def nccl_shards(state: dict[str, Any], bucket_mb: float, gpus: int) -> dict[str, Any]:
    """Sharded senders over NCCL: min(2, GPUs - 1) trainer ranks, each on its GPU with the
    tensors it holds, send their buckets at once to one replica on the last GPU, which checks
    every bucket's checksum and assembles the bf16 weights; checksummed tensor by tensor."""
    import multiprocessing as mp

    import torch

    from rl360.weights.plan import checksum_state, compare_checksums
    from rl360.weights.shards import bucket_limit, combine, rank_part

    if gpus < 2:
        return {"ok": None, "not_run": f"{gpus} GPU(s): a sender and a replica need a GPU each "
                                       "(NCCL refuses two ranks on one GPU)"}
    ranks = min(2, gpus - 1)
    limit = bucket_limit(bucket_mb)
    plan = combine([rank_part(state, r, ranks, "bfloat16", limit)[0] for r in range(ranks)],
                   limit)
    want = checksum_state({k: v.to(torch.bfloat16) if v.is_floating_point() else v
                           for k, v in state.items()})
    ctx = mp.get_context("spawn")
    q, rq = ctx.Queue(), ctx.Queue()
    senders = [ctx.Process(target=_shard_sender, args=(r, ranks, state, bucket_mb, q),
                           daemon=True) for r in range(ranks)]
    procs = list(senders)
    try:
        for p in senders:
            p.start()
        addrs: dict[int, tuple[str, int]] = {}
        while len(addrs) < ranks:
            msg = q.get(timeout=120)
            if "error" in msg:
                return {"ok": False, "error": msg["error"]}
            addrs[msg["rank"]] = tuple(msg["addr"])
        t0 = time.perf_counter()
        receiver = ctx.Process(target=_shard_receiver, args=(plan, addrs, ranks, rq), daemon=True)
        procs.append(receiver)
        receiver.start()
        got = rq.get(timeout=180)
        secs = time.perf_counter() - t0
        sent = [q.get(timeout=60) for _ in range(ranks)]
        if "error" in got or any("error" in s for s in sent):
            return {"ok": False, "error": got.get("error") or [s for s in sent if "error" in s]}
        rep = compare_checksums(want, got["sums"], version=1, replica="shards")
        return {"ok": rep.ok, "summary": rep.summary(), "ranks": ranks,
                "buckets": sum(len(b) for b in plan.ranks), "bytes": plan.nbytes,
                "seconds_with_join": secs}
    except Exception as exc:
        return {"ok": False, "error": repr(exc)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()  # our own child


def nccl(args: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing as mp

    import torch

    from rl360.ray_session import free_port
    from rl360.weights.nccl import GroupSender
    from rl360.weights.plan import checksum_state, compare_checksums, plan_buckets

    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(1024, 1024, generator=g).to(torch.bfloat16)
             for i in range(24)}
    state["norm.weight"] = torch.randn(1024, generator=g)
    sender = GroupSender(lambda: state)
    buckets = plan_buckets(sender.spec(), args.bucket_mb)
    want = checksum_state(state)
    ctx = mp.get_context("spawn")
    gpus = torch.cuda.device_count()
    res: dict[str, Any] = {"tensors": len(state), "buckets": len(buckets), "gpus": gpus}
    # CUDA IPC: the colocated path (trainer and engine on one GPU)
    torch.cuda.set_device(0)
    q = ctx.Queue()
    child = ctx.Process(target=_ipc_receiver, args=(sender.ipc_payload(1)[0], q), daemon=True)
    child.start()
    try:
        got = q.get(timeout=120)
    finally:
        child.join(timeout=30)
        sender.release_ipc()
    if "error" in got:
        res["ipc"] = {"ok": False, "error": got["error"]}
    else:
        rep = compare_checksums(want, got["sums"], version=1, replica="ipc")
        res["ipc"] = {"ok": rep.ok, "summary": rep.summary()}
    # NCCL: rank 0 here on GPU 0, rank 1 in a child on GPU 1 (NCCL refuses two ranks on one
    # GPU, so on a one-GPU machine this is reported as not run, never as passed)
    if gpus < 2:
        res["nccl"] = {"ok": None, "not_run": f"{gpus} GPU(s): NCCL needs a GPU per rank"}
    else:
        q = ctx.Queue()
        port, group = free_port(), "rl360-gpu-check"
        child = ctx.Process(target=_nccl_receiver, args=(port, group, buckets, 1, q), daemon=True)
        child.start()
        try:
            sender.open("127.0.0.1", port, 2, "nccl", group, timeout_s=90)
            t0 = time.perf_counter()
            sent = sender.send(buckets, "per_tensor")
            got = q.get(timeout=120)
            secs = time.perf_counter() - t0
            sender.close()
            if "error" in got:
                res["nccl"] = {"ok": False, "error": got["error"]}
            else:
                rep = compare_checksums(want, got["sums"], version=1, replica="nccl-rank1")
                res["nccl"] = {"ok": rep.ok, "summary": rep.summary(), "bytes": sent,
                               "gb_per_s": sent / secs / 1e9}
        except Exception as exc:
            res["nccl"] = {"ok": False, "error": repr(exc)}
        finally:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()  # our own child
    res["shards"] = nccl_shards(state, args.bucket_mb, gpus)
    res["ok"] = bool(res["ipc"]["ok"] and res["nccl"]["ok"] is not False
                     and res["shards"]["ok"] is not False)
    return res


# ----------------------------------------------------------------------------- bench


async def raw_tps(engine: str, model: str, sessions: int, requests: int,
                  max_tokens: int) -> float:
    from bench.serve_overhead import MESSAGES
    from rl360.policies.chat import ChatRenderer
    from rl360.policies.loading import load_tokenizer
    from rl360.recipe import EngineSection, ModelSection
    from rl360.serve.engines.base import build_engine_backend
    from rl360.types import Message, SamplingParams

    r = ChatRenderer(load_tokenizer(model))
    ids = r.render([Message(**m) for m in MESSAGES], None, add_generation_prompt=True)
    be = build_engine_backend(
        EngineSection(backend=engine, max_batch_size=128, options=dict(ENGINE_OPTIONS[engine])),
        ModelSection(path=model, dtype="bfloat16"), seed=0)
    try:
        async def worker(w: int) -> int:
            n = 0
            for i in range(requests):
                sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=w * 1000 + i,
                                    eos_token_ids=r.eos_ids)
                n += len((await be.generate(ids, sp)).token_ids)
            return n

        await worker(0)  # warm-up
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(worker(w) for w in range(sessions))))
        return tokens / (time.perf_counter() - t0)
    finally:
        await be.close()


def bench_recipe(engine: str, model: str, port: int) -> Any:
    from rl360.recipe import apply_overrides, decode_recipe

    data = apply_overrides({}, [
        f"engine.backend='{engine}'", f"model.path={json.dumps(model)}",
        "model.dtype='bfloat16'", "engine.num_gpus=1", "engine.num_cpus=2",
        "engine.max_batch_size=128", f"serve.port={port}", "ray.dashboard=false"])
    data["engine"]["options"] = dict(ENGINE_OPTIONS[engine])
    return decode_recipe(data)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from bench.serve_overhead import through_server
    from rl360.launch.serve_app import start_serving, stop_serving
    from rl360.ray_session import free_port, ray_session

    raw = asyncio.run(raw_tps(args.engine, args.model, args.sessions, args.requests,
                              args.max_tokens))
    log(f"{args.engine} raw engine API: {raw:.0f} tok/s")
    recipe = bench_recipe(args.engine, args.model, free_port())
    with ray_session(num_cpus=max(4, (os.cpu_count() or 4) - 2), dashboard=False,
                     namespace="rl360-gpu-bench"):
        h = start_serving(recipe, timeout_s=600)
        try:
            secs, tokens = asyncio.run(through_server(args, h.base_url))
        finally:
            stop_serving(h)
    served = tokens / secs
    log(f"{args.engine} through the session server: {served:.0f} tok/s")
    return {"bench": f"serve_overhead_{args.engine}", "ours": round(served, 1),
            "baseline": round(raw, 1), "ratio": round(served / raw, 3)}


# ----------------------------------------------------------------------------- main


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """Imports and wiring only: what each subcommand would run, without a GPU."""
    import importlib.util

    import torch

    from rl360.recipe import EngineSection, ModelSection
    from rl360.serve.engines.base import BACKENDS
    from rl360.serve.engines.sglang_backend import engine_kwargs
    from rl360.weights import nccl as _nccl

    wired: dict[str, Any] = {"nccl_sender": _nccl.GroupSender.__name__}
    if args.cmd in ("parity", "bench"):
        cfg = EngineSection(backend=args.engine, options=dict(ENGINE_OPTIONS[args.engine]))
        if args.engine == "sglang":
            wired["engine_kwargs"] = engine_kwargs(
                cfg, ModelSection(path=args.model, dtype="bfloat16"), 0, args.model)
    if args.cmd == "bench":
        from bench.serve_overhead import MESSAGES, through_server

        recipe = bench_recipe(args.engine, args.model, 8000)
        wired["recipe_engine"] = [recipe.engine.backend, recipe.engine.num_gpus,
                                  recipe.engine.options]
        wired["bench_helpers"] = [through_server.__name__, len(MESSAGES)]
    need = {"build-model": [], "parity": [getattr(args, "engine", "")],
            "bench": [getattr(args, "engine", "")], "nccl": []}[args.cmd]
    missing = [m for m in need if m and importlib.util.find_spec(m) is None]
    return {"dry_run": args.cmd, "args": vars(args), "backends": sorted(BACKENDS),
            "cuda": torch.cuda.is_available(), "missing_here": missing, "wired": wired}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-model")
    b.add_argument("dir")
    b.add_argument("--layers", type=int, default=24)
    b.add_argument("--vocab-size", type=int, default=320)
    p = sub.add_parser("parity")
    p.add_argument("--engine", choices=sorted(ENGINE_OPTIONS), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--tie-tol", type=float, default=0.05)
    p.add_argument("--lp-tol", type=float, default=0.15)
    n = sub.add_parser("nccl")
    n.add_argument("--out", required=True)
    n.add_argument("--bucket-mb", type=float, default=8.0)
    c = sub.add_parser("bench")
    c.add_argument("--engine", choices=sorted(ENGINE_OPTIONS), required=True)
    c.add_argument("--model", required=True)
    c.add_argument("--sessions", type=int, default=16)
    c.add_argument("--requests", type=int, default=4)
    c.add_argument("--max-tokens", type=int, default=64)
    for sp in (b, p, n, c):
        sp.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    if args.dry_run:
        print(json.dumps(dry_run(args)))
        return 0
    if args.cmd == "build-model":
        build_model(Path(args.dir), args.layers, args.vocab_size)
        return 0
    if args.cmd == "bench":
        print(json.dumps(bench(args)))
        return 0
    res = asyncio.run(parity(args)) if args.cmd == "parity" else nccl(args)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items()
                      if k in ("ok", "engine", "nccl", "ipc", "shards")}))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
