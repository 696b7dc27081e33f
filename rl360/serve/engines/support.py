"""What each engine backend can run, as plain data (rl360.types.BackendSupport).

`rl360 plan` and `rl360 preflight` check a recipe against ENGINE_SUPPORT before anything
starts (rl360.launch.support); the backends are built from the same names (base.BACKENDS).
Imports nothing heavy.
"""

from __future__ import annotations

from rl360.types import BackendSupport

_FLOATS = ("float32", "bfloat16", "float16")

ENGINE_SUPPORT: dict[str, BackendSupport] = {
    "torch": BackendSupport(
        backend="torch", devices=("cpu", "cuda"), dtypes=_FLOATS,
        notes="Llama-shaped HF models (llama, mistral, qwen2, qwen3), continuous batching, "
              "prefix cache, in-flight weight updates; one device per replica"),
    "scripted": BackendSupport(
        backend="scripted", devices=("cpu",), dtypes=_FLOATS,
        notes="scripted answers for tests; no model"),
    "vllm": BackendSupport(
        backend="vllm", devices=("cpu", "cuda"), dtypes=_FLOATS, tensor_parallel=64,
        notes="tensor_parallel_size = engine.tensor_parallel; expert parallelism is not wired"),
    "sglang": BackendSupport(
        backend="sglang", devices=("cuda",), dtypes=_FLOATS, tensor_parallel=64,
        expert_parallel=64, remote_option="url",
        notes="tp_size = engine.tensor_parallel, ep_size = engine.expert_parallel (inside the "
              "tensor-parallel group); options.url: a server elsewhere (its own GPUs)"),
}
