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


# the adapter ranks vLLM reserves room for (its LoRAConfig.max_lora_rank choices)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_options(backend: str, rank: int, targets: list[str]) -> dict[str, object]:
    """engine.options an engine needs at start to serve adapter versions (trainer.lora) of this
    rank on these projections: vLLM and SGLang reserve adapter memory when they start; the
    torch engine wraps its projections at the first adapter version and needs none."""
    if backend == "vllm":
        fit = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
        if fit is None:
            raise ValueError(f"trainer.lora.rank = {rank}: vLLM serves adapters up to rank "
                             f"{VLLM_LORA_RANKS[-1]}")
        return {"enable_lora": True, "max_lora_rank": fit, "max_loras": 1}
    if backend == "sglang":
        return {"enable_lora": True, "max_lora_rank": rank, "lora_target_modules": list(targets),
                "max_loras_per_batch": 1}
    return {}
