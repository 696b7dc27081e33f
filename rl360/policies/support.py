"""What each trainer backend can run, as plain data (rl360.types.BackendSupport).

`rl360 plan` and `rl360 preflight` check a recipe against TRAINER_SUPPORT before anything
starts (rl360.launch.support), and the backends refuse the same things at start-up (the
megatron converter's families and MegatronTrainer's parallel layouts come from here). Imports
nothing heavy.
"""

from __future__ import annotations

from rl360.types import BackendSupport

TRAINER_SUPPORT: dict[str, BackendSupport] = {
    "torch": BackendSupport(
        backend="torch", devices=("cpu", "cuda"), dtypes=("float32", "bfloat16"),
        notes="replicated data parallel: every rank holds the whole model and optimizer"),
    # FSDP2 shards every parameter over the data-parallel ranks, whatever the module is, so any
    # AutoModelForCausalLM (a mixture of experts too: experts are sharded like any weight, with
    # no expert parallelism) fits once its shards do
    "fsdp": BackendSupport(
        backend="fsdp", devices=("cpu", "cuda"), dtypes=("float32", "bfloat16"),
        notes="FSDP2 (fully_shard): parameters, gradients and optimizer sharded over the "
              "data-parallel ranks; no tensor/pipeline/context/expert parallel"),
    "megatron": BackendSupport(
        backend="megatron", devices=("cpu", "cuda"), dtypes=("float32", "bfloat16"),
        families=("llama", "qwen2", "qwen3"), moe=False, tensor_parallel=64,
        notes="megatron-core GPTModel: tensor x data parallel; pipeline, context and expert "
              "parallel are not implemented"),
}
