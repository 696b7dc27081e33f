"""HF <-> megatron-core weight conversion for Llama-, Qwen2- and Qwen3-family (dense) causal LMs.

Megatron's GPT layer (local spec) differs from HF's Llama/Qwen2 layer in three ways:
- q, k and v are one `linear_qkv` whose output rows are grouped by KV head: for each of the
  `num_query_groups` groups, that group's query heads, then its key head, then its value head
  (each `head_dim` rows). Qwen2's q/k/v biases are fused the same way.
- gate and up projections are one `linear_fc1` = [gate; up] (megatron's SwiGLU computes
  silu(first half) * second half).
- names: embedding.word_embeddings, decoder.layers.N.{input_layernorm, self_attention.linear_qkv,
  self_attention.linear_proj, pre_mlp_layernorm, mlp.linear_fc1, mlp.linear_fc2},
  decoder.final_layernorm, output_layer (absent when the embeddings are tied).
- Qwen3's QK-norm (an RMSNorm over head_dim applied to each query and key head before RoPE,
  `self_attn.q_norm` / `k_norm`) is megatron's `self_attention.q_layernorm` / `k_layernorm`
  (qk_layernorm=True), copied as is and replicated over tensor-parallel ranks. Qwen3 has no
  q/k/v biases and its head_dim is its own (not hidden_size / heads).

Both directions only reshape and concatenate/split, so a round trip is bit-exact. Nothing here
imports megatron-core.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch
from torch import Tensor

from rl360.policies.support import TRAINER_SUPPORT

# the megatron trainer backend's declared families (what `rl360 plan` checks recipes against)
SUPPORTED = TRAINER_SUPPORT["megatron"].families


class GPTShape(msgspec.Struct, frozen=True, kw_only=True):
    """What the conversion and the megatron model need to know about an HF config."""

    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_positions: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm on each query / key head (q_layernorm, k_layernorm)


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"megatron conversion: rope type {kind!r} is not supported "
                         "(only plain RoPE)")
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise ValueError("megatron conversion: the HF config has no rope_theta")
    return float(theta)


def shape_from_hf(cfg: Any) -> GPTShape:
    """A GPTShape from a transformers config, or a ValueError naming what is unsupported."""
    family = getattr(cfg, "model_type", None)
    if family not in SUPPORTED:
        raise ValueError(f"megatron conversion: model_type {family!r} not in {list(SUPPORTED)}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"megatron conversion: hidden_act {cfg.hidden_act!r} is not 'silu'")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("megatron conversion: mlp_bias=True is not supported")
    if family == "llama" and getattr(cfg, "attention_bias", False):
        raise ValueError("megatron conversion: llama attention_bias=True (o_proj bias) is not "
                         "supported")
    if family in ("qwen2", "qwen3") and getattr(cfg, "use_sliding_window", False):
        raise ValueError(f"megatron conversion: {family} use_sliding_window=True is not "
                         "supported")
    if family == "qwen3" and getattr(cfg, "attention_bias", False):
        raise ValueError("megatron conversion: qwen3 attention_bias=True is not supported")
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    if heads % kv:
        raise ValueError(f"megatron conversion: {heads} attention heads not divisible by "
                         f"{kv} key/value heads")
    head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
    return GPTShape(
        family=family, vocab_size=int(cfg.vocab_size), hidden_size=int(cfg.hidden_size),
        ffn_hidden_size=int(cfg.intermediate_size), num_layers=int(cfg.num_hidden_layers),
        num_heads=heads, num_kv_heads=kv, head_dim=int(head_dim),
        norm_eps=float(cfg.rms_norm_eps), rope_theta=_rope_theta(cfg),
        max_positions=int(cfg.max_position_embeddings),
        tied=bool(getattr(cfg, "tie_word_embeddings", False)), qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
    )


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, s: GPTShape) -> Tensor:
    g, d = s.num_kv_heads, s.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(g, -1, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: Tensor, s: GPTShape) -> tuple[Tensor, Tensor, Tensor]:
    g, d, per = s.num_kv_heads, s.head_dim, s.num_heads // s.num_kv_heads
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, per + 2, d, *rest)
    q, k, v = grouped.split([per, 1, 1], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def _need(sd: dict[str, Tensor], key: str) -> Tensor:
    if key not in sd:
        raise KeyError(f"megatron conversion: state dict has no {key!r}")
    return sd[key]


def hf_to_mcore(hf: dict[str, Tensor], s: GPTShape) -> dict[str, Tensor]:
    out = {"embedding.word_embeddings.weight": _need(hf, "model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": _need(hf, "model.norm.weight")}
    if not s.tied:
        out["output_layer.weight"] = _need(hf, "lm_head.weight")
    for i in range(s.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[m + "input_layernorm.weight"] = _need(hf, h + "input_layernorm.weight")
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            _need(hf, a + "q_proj.weight"), _need(hf, a + "k_proj.weight"),
            _need(hf, a + "v_proj.weight"), s)
        if s.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                _need(hf, a + "q_proj.bias"), _need(hf, a + "k_proj.bias"),
                _need(hf, a + "v_proj.bias"), s)
        if s.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = _need(hf, a + "q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = _need(hf, a + "k_norm.weight")
        out[m + "self_attention.linear_proj.weight"] = _need(hf, a + "o_proj.weight")
        out[m + "pre_mlp_layernorm.weight"] = _need(hf, h + "post_attention_layernorm.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [_need(hf, h + "mlp.gate_proj.weight"), _need(hf, h + "mlp.up_proj.weight")], dim=0)
        out[m + "mlp.linear_fc2.weight"] = _need(hf, h + "mlp.down_proj.weight")
    return out


def mcore_to_hf(mc: dict[str, Tensor], s: GPTShape) -> dict[str, Tensor]:
    """HF names; with tied embeddings lm_head.weight IS model.embed_tokens.weight (one tensor),
    as in an HF model's own state_dict."""
    embed = _need(mc, "embedding.word_embeddings.weight")
    out = {"model.embed_tokens.weight": embed,
           "model.norm.weight": _need(mc, "decoder.final_layernorm.weight"),
           "lm_head.weight": embed if s.tied else _need(mc, "output_layer.weight")}
    for i in range(s.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[h + "input_layernorm.weight"] = _need(mc, m + "input_layernorm.weight")
        q, k, v = _split_qkv(_need(mc, m + "self_attention.linear_qkv.weight"), s)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        if s.qkv_bias:
            q, k, v = _split_qkv(_need(mc, m + "self_attention.linear_qkv.bias"), s)
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = q, k, v
        if s.qk_norm:
            out[a + "q_norm.weight"] = _need(mc, m + "self_attention.q_layernorm.weight")
            out[a + "k_norm.weight"] = _need(mc, m + "self_attention.k_layernorm.weight")
        out[a + "o_proj.weight"] = _need(mc, m + "self_attention.linear_proj.weight")
        out[h + "post_attention_layernorm.weight"] = _need(mc, m + "pre_mlp_layernorm.weight")
        gate, up = _need(mc, m + "mlp.linear_fc1.weight").chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"] = gate.contiguous()
        out[h + "mlp.up_proj.weight"] = up.contiguous()
        out[h + "mlp.down_proj.weight"] = _need(mc, m + "mlp.linear_fc2.weight")
    return out


# ----------------------------------------------------------------------------- tensor parallel
# How megatron splits each tensor over tensor-parallel ranks: column-parallel layers (and the
# vocab-parallel embedding) by output rows, row-parallel layers by input columns, norms
# replicated. linear_qkv rows are grouped by KV head, so a row chunk is a set of whole query
# groups; linear_fc1 is [gate; up] on EVERY rank, i.e. rank r holds [gate_r; up_r].

_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "embedding.word_embeddings.weight",
           "output_layer.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_GLU = "linear_fc1.weight"


def tp_split_dim(name: str) -> int | None:
    """The dimension `name` is split on over tensor-parallel ranks (None: replicated)."""
    if name.endswith(_COLUMN) or name.endswith(_GLU):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def _chunks(t: Tensor, n: int, dim: int, name: str) -> tuple[Tensor, ...]:
    if t.shape[dim] % n:
        raise ValueError(f"megatron tensor parallel: {name} dim {dim} ({t.shape[dim]}) is not "
                         f"divisible by tensor_parallel {n}")
    return t.chunk(n, dim=dim)


def shard_tp(mc: dict[str, Tensor], tp_size: int, tp_rank: int) -> dict[str, Tensor]:
    """Rank `tp_rank`'s slice of full (TP = 1) megatron tensors."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    out = {}
    for name, t in mc.items():
        dim = tp_split_dim(name)
        if dim is None or tp_size == 1:
            out[name] = t
        elif name.endswith(_GLU):
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([_chunks(gate, tp_size, 0, name)[tp_rank],
                                   _chunks(up, tp_size, 0, name)[tp_rank]])
        else:
            out[name] = _chunks(t, tp_size, dim, name)[tp_rank].contiguous()
    return out


def unshard_tp(shards: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Full (TP = 1) megatron tensors from every tensor-parallel rank's slice, in rank order."""
    if len(shards) == 1:
        return dict(shards[0])
    out = {}
    for name, first in shards[0].items():
        dim = tp_split_dim(name)
        parts = [s[name] for s in shards]
        if dim is None:
            out[name] = first
        elif name.endswith(_GLU):
            halves = [p.chunk(2, dim=0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            out[name] = torch.cat(parts, dim=dim)
    return out
