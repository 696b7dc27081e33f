"""A megatron-core GPTModel built from an HF Llama/Qwen2/Qwen3 config, and its parallel state.

The model uses megatron's local layer spec (no Transformer Engine, no apex) with every fusion
off, so the same code runs on CPU (through `cpu_shims`) and on GPUs. Weights come from the HF
checkpoint via `convert.hf_to_mcore` (then sliced per tensor-parallel rank).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rl360.policies.megatron import cpu_shims
from rl360.policies.megatron.convert import GPTShape, hf_to_mcore, shard_tp, unshard_tp
from rl360.recipe import TrainerSection


@dataclass(frozen=True)
class ParallelConfig:
    """The model-parallel sizes handed to megatron's parallel_state (data parallel is the
    rest), read from the recipe's [trainer] section; the bounds live there."""

    tensor: int
    pipeline: int
    context: int
    expert: int

    @classmethod
    def of(cls, t: TrainerSection) -> ParallelConfig:
        return cls(tensor=t.megatron.tensor_parallel, pipeline=t.megatron.pipeline_parallel,
                   context=t.megatron.context_parallel, expert=t.megatron.expert_parallel)

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline * self.context * self.expert


def on_gpu() -> bool:
    return torch.cuda.is_available()


def init_parallel(par: ParallelConfig, seed: int) -> None:
    """torch.distributed (a 1-process gloo group when the caller has none) + megatron's
    parallel_state. On CPU (the CPU shims go in) data and tensor parallel run over gloo;
    pipeline/context/expert parallel need GPUs."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not on_gpu():
        if par.model_parallel != par.tensor:
            raise ValueError(f"megatron backend on CPU runs only pipeline/context/"
                             f"expert_parallel = 1, got {par}: those need GPUs")

        cpu_shims.install()
    if not dist.is_initialized():
        backend = "nccl" if on_gpu() else "gloo"
        # one process: an in-memory store, no port to find (or to lose to another process)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=600))
    if on_gpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    world = dist.get_world_size()
    if world % par.model_parallel:
        raise ValueError(f"trainer world size {world} is not a multiple of the model-parallel "
                         f"size {par.model_parallel} ({par})")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=par.tensor, pipeline_model_parallel_size=par.pipeline,
            context_parallel_size=par.context, expert_model_parallel_size=par.expert)
    elif (ps.get_tensor_model_parallel_world_size(),
          ps.get_pipeline_model_parallel_world_size()) != (par.tensor, par.pipeline):
        raise ValueError(f"megatron parallel_state in this process is already set up with "
                         f"TP {ps.get_tensor_model_parallel_world_size()} x PP "
                         f"{ps.get_pipeline_model_parallel_world_size()}, not {par}")
    if on_gpu():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(s: GPTShape, par: ParallelConfig) -> Any:
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=s.num_layers, hidden_size=s.hidden_size, ffn_hidden_size=s.ffn_hidden_size,
        num_attention_heads=s.num_heads, num_query_groups=s.num_kv_heads, kv_channels=s.head_dim,
        normalization="RMSNorm", layernorm_epsilon=s.norm_eps,
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=s.qkv_bias, qk_layernorm=s.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, use_cpu_initialization=not on_gpu(),
        # the weights are overwritten from the HF checkpoint, but megatron's init also marks
        # TP-sliced parameters (`tensor_model_parallel`), which the grad norm needs
        perform_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        # sum (not average) gradients over data-parallel ranks: the reducers divide by the
        # global token / sequence counts already
        calculate_per_token_loss=True,
        tensor_model_parallel_size=par.tensor, pipeline_model_parallel_size=par.pipeline,
        context_parallel_size=par.context, expert_model_parallel_size=par.expert,
        sequence_parallel=False,
    )


def build_gpt(s: GPTShape, par: ParallelConfig) -> Any:
    """An (uninitialized) GPTModel for this rank's pipeline stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    for what, n in (("vocab size", s.vocab_size), ("key/value heads", s.num_kv_heads),
                    ("ffn hidden size", s.ffn_hidden_size)):
        if n % par.tensor:
            raise ValueError(f"{what} {n} not divisible by tensor_parallel {par.tensor}")
    model = GPTModel(
        transformer_config(s, par), get_gpt_layer_local_spec(normalization="RMSNorm",
                                                             qk_layernorm=s.qk_norm),
        vocab_size=s.vocab_size, max_sequence_length=s.max_positions,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=s.tied, position_embedding_type="rope",
        rotary_base=int(s.rope_theta) if float(s.rope_theta).is_integer() else s.rope_theta,
    )
    return model.cuda() if on_gpu() else model


def read_hf_weights(model_dir: str | Path) -> dict[str, Tensor]:
    """All tensors of an HF safetensors checkpoint (one file or shards), on CPU."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors (the megatron backend reads "
                                "HF safetensors checkpoints only)")
    out: dict[str, Tensor] = {}
    for f in files:
        out.update(load_file(f, device="cpu"))
    return out


def load_hf_into(model: Any, hf: dict[str, Tensor], s: GPTShape) -> None:
    """Copy HF weights into this rank's GPTModel (its tensor-parallel slice); every parameter
    must be set."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("loading HF weights into a pipeline-parallel GPTModel is not "
                                  "implemented")
    mc = shard_tp(hf_to_mcore(hf, s), ps.get_tensor_model_parallel_world_size(),
                  ps.get_tensor_model_parallel_rank())
    missing, unexpected = model.load_state_dict(mc, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"HF -> megatron weights: missing {missing}, unexpected {unexpected}")


def mcore_state(model: Any) -> dict[str, Tensor]:
    """The model's tensors by megatron name, without megatron's `_extra_state` entries."""
    return {k: v for k, v in model.state_dict().items()
            if not k.endswith("_extra_state") and isinstance(v, Tensor)}


def gather_full_state(model: Any) -> dict[str, Tensor]:
    """Full (TP = 1) megatron tensors, detached CPU copies, gathered from every
    tensor-parallel rank. A collective: every rank of the TP group must call it."""
    from megatron.core import parallel_state as ps

    local = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in mcore_state(model).items()}
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return local
    group = ps.get_tensor_model_parallel_group()
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    device = next(iter(model.parameters())).device
    for name, t in local.items():
        mine = t.to(device)
        parts = [torch.empty_like(mine) for _ in range(tp)]
        dist.all_gather(parts, mine, group=group)
        for r, part in enumerate(parts):
            shards[r][name] = part.cpu()
    return unshard_tp(shards)
