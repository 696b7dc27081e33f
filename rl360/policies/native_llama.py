"""Our own Llama modules: an HF Llama checkpoint loaded without transformers' modeling code, for
the torch engine and the torch trainer.

Importing transformers' Llama modeling takes ~3 s on top of torch (it pulls in torch._dynamo,
torch.distributed.tensor, the hub-kernel and masking machinery) in every process that holds the
policy: the engine replica, whose start-up a run waits for last, and the trainer, which starts
beside it on the same cores. Without it (the tokenizer still imports part of transformers) an
engine replica's import + load went from 5.3 to 3.1 CPU s, a trainer's from 6.4 to 4.9. These
modules are the same computations in the same order (HF's RMSNorm, SiLU MLP, default RoPE, SDPA
causal attention), with the same parameter names, so weight sync, slots served in place and
checkpoints see the same state dict, and `save_pretrained` writes a checkpoint transformers
loads. The engine's `LlamaRunner` (serve/engines/torch_model.py) calls the modules one by one
over its slot KV cache; the trainer calls `forward` (logits) or `get_decoder()` (hidden states,
for `token_logprobs`). `tests/policies/test_native_llama.py` checks the engine's logits against
transformers' bit for bit (tiny presets, SmolLM2) and a trainer step against the HF model's.

Only plain Llama configs load here (`native_config` says which: model_type "llama", SiLU,
default RoPE, no biases); anything else goes through transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rl360.policies.shared_prefix import PrefixLayout


@dataclass(frozen=True)
class NativeLlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    eos_token_id: Any = None
    pad_token_id: Any = None
    raw: tuple[tuple[str, Any], ...] = ()  # config.json as read (written back by save_pretrained)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.raw)


def _rope(raw: dict[str, Any]) -> tuple[str, float] | None:
    """(rope type, theta) from a config of either transformers generation, None if absent."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", raw.get("rope_theta"))
    return (kind, float(theta)) if theta is not None else None


def native_config(path: str | Path) -> NativeLlamaConfig | None:
    """The config at `path` when these modules run it exactly, else None."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    try:  # a config short of a size, a broken index: transformers' loader names what is wrong
        rope = _rope(raw)
        if (raw.get("model_type") != "llama" or raw.get("hidden_act", "silu") != "silu"
                or rope is None or rope[0] != "default" or raw.get("attention_bias")
                or raw.get("mlp_bias") or raw.get("pretraining_tp", 1) != 1
                or not _weight_files(Path(path))):
            return None
        return _parse(raw, rope[1])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _parse(raw: dict[str, Any], theta: float) -> NativeLlamaConfig:
    heads = int(raw["num_attention_heads"])
    return NativeLlamaConfig(
        model_type="llama", vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]), intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_id=raw.get("eos_token_id"), pad_token_id=raw.get("pad_token_id"),
        raw=tuple(raw.items()),
    )


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    return [single] if single.is_file() else []


class Linear(nn.Linear):
    """nn.Linear without the initialisation: the checkpoint's weights replace it (building on
    the meta device instead would import torch._dynamo, ~1 CPU s)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, cfg: NativeLlamaConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, bias=False)
        self.up_proj = Linear(h, i, bias=False)
        self.down_proj = Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """RoPE on q, k [B, heads, T, D] with cos, sin [B, T, D] (HF's rotate-half layout)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(nn.Module):
    """The projections; `forward` is causal self-attention over whole rows (the trainer's
    forward; the engine's runner does its own over the KV cache)."""

    def __init__(self, cfg: NativeLlamaConfig) -> None:
        super().__init__()
        d, h = cfg.head_dim, cfg.hidden_size
        self.head_dim = d
        self.gqa = cfg.num_key_value_heads != cfg.num_attention_heads
        self.q_proj = Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = Linear(cfg.num_attention_heads * d, h, bias=False)
        self.scaling = d**-0.5

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t = x.shape[:2]
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        o = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=self.scaling,
                                                       is_causal=t > 1, enable_gqa=self.gqa)
        return self.o_proj(o.transpose(1, 2).contiguous().reshape(b, t, -1).contiguous())

    def forward_shared(self, xp: Tensor, xs: Tensor, rope_p: tuple[Tensor, Tensor],
                       rope_s: tuple[Tensor, Tensor], row_prefix: Tensor,
                       mask: Tensor) -> tuple[Tensor, Tensor]:
        """Prefixes xp [P, Lp, H] (causal over themselves) and suffixes xs [B, Ls, H], each
        suffix attending to its prefix's keys/values (`row_prefix`) and causally to its own,
        as `mask` [B, 1, Ls, Lp + Ls] allows (policies/shared_prefix.py)."""
        p, lp = xp.shape[:2]
        b, ls = xs.shape[:2]
        qp = self.q_proj(xp).view(p, lp, -1, self.head_dim).transpose(1, 2)
        kp = self.k_proj(xp).view(p, lp, -1, self.head_dim).transpose(1, 2)
        vp = self.v_proj(xp).view(p, lp, -1, self.head_dim).transpose(1, 2)
        qp, kp = apply_rotary_pos_emb(qp, kp, *rope_p)
        op = nn.functional.scaled_dot_product_attention(
            qp, kp, vp, dropout_p=0.0, scale=self.scaling, is_causal=lp > 1, enable_gqa=self.gqa)
        qs = self.q_proj(xs).view(b, ls, -1, self.head_dim).transpose(1, 2)
        ks = self.k_proj(xs).view(b, ls, -1, self.head_dim).transpose(1, 2)
        vs = self.v_proj(xs).view(b, ls, -1, self.head_dim).transpose(1, 2)
        qs, ks = apply_rotary_pos_emb(qs, ks, *rope_s)
        k = torch.cat([kp[row_prefix], ks], dim=2)
        v = torch.cat([vp[row_prefix], vs], dim=2)
        os_ = nn.functional.scaled_dot_product_attention(
            qs, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scaling, enable_gqa=self.gqa)
        return (self.o_proj(op.transpose(1, 2).reshape(p, lp, -1).contiguous()),
                self.o_proj(os_.transpose(1, 2).reshape(b, ls, -1).contiguous()))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: NativeLlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_shared(self, xp: Tensor, xs: Tensor, rope_p: tuple[Tensor, Tensor],
                       rope_s: tuple[Tensor, Tensor], row_prefix: Tensor,
                       mask: Tensor) -> tuple[Tensor, Tensor]:
        ap, as_ = self.self_attn.forward_shared(self.input_layernorm(xp),
                                                self.input_layernorm(xs), rope_p, rope_s,
                                                row_prefix, mask)
        xp, xs = xp + ap, xs + as_
        return (xp + self.mlp(self.post_attention_layernorm(xp)),
                xs + self.mlp(self.post_attention_layernorm(xs)))


@dataclass
class Output:
    """What the trainer reads of an HF model's output."""

    last_hidden_state: Tensor | None = None
    logits: Tensor | None = None


class RotaryEmbedding(nn.Module):
    """Default RoPE: (cos, sin) [B, T, head_dim] of positions [B, T], in x's dtype."""

    rope_type = "default"

    def __init__(self, cfg: NativeLlamaConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64)
                                             .to(dtype=torch.float) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        inv = inv.to(x.device)
        pos = position_ids[:, None, :].float()
        freqs = (inv @ pos).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Decoder(nn.Module):
    def __init__(self, cfg: NativeLlamaConfig) -> None:
        super().__init__()
        pad = cfg.pad_token_id  # its embedding row gets no gradient from lookups, as in HF's
        self.embed_tokens = Embedding(
            cfg.vocab_size, cfg.hidden_size,
            padding_idx=pad if isinstance(pad, int) and 0 <= pad < cfg.vocab_size else None)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, use_cache: bool = False) -> Output:
        """Hidden states after the final norm, [B, T, H], of right-padded rows (causal: a real
        token never attends to a later pad, so no padding mask is needed or taken)."""
        if attention_mask is not None:
            raise ValueError("the native Llama forward takes no attention_mask (right padding "
                             "only); set trainer.attention_mask = false or native_llama = false")
        x = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=x.device)[None]
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return Output(last_hidden_state=self.norm(x))

    def forward_shared(self, layout: PrefixLayout) -> Tensor:
        """Hidden states after the final norm of the rows `layout` describes, [B, L, H], each
        shared prefix run once (zeros over the prefixes, which carry no loss:
        policies/shared_prefix.py)."""
        xp = self.embed_tokens(layout.prefix_ids)
        xs = self.embed_tokens(layout.suffix_ids)
        (p, lp), (b, ls) = layout.prefix_ids.shape, layout.suffix_ids.shape
        dev = xs.device
        rope_p = self.rotary_emb(xp, torch.arange(lp, device=dev)[None].expand(p, lp))
        rope_s = self.rotary_emb(xs, layout.split[:, None] + torch.arange(ls, device=dev)[None])
        prefix_keys = torch.arange(lp, device=dev)[None] < layout.split[:, None]  # [B, Lp]
        causal = torch.ones((ls, ls), dtype=torch.bool, device=dev).tril()
        mask = torch.cat([prefix_keys[:, None, :].expand(b, ls, lp),
                          causal[None].expand(b, ls, ls)], dim=-1)[:, None]
        for layer in self.layers:
            xp, xs = layer.forward_shared(xp, xs, rope_p, rope_s, layout.row_prefix, mask)
        return layout.scatter(self.norm(xs))


class NativeLlamaForCausalLM(nn.Module):
    """HF LlamaForCausalLM's module tree, parameter names and the parts of its interface the
    engine and the trainer use (`forward` -> `.logits`, `get_decoder`, `get_output_embeddings`,
    `save_pretrained`)."""

    def __init__(self, cfg: NativeLlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.name_or_path = ""
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_decoder(self) -> Decoder:
        return self.model

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, use_cache: bool = False) -> Output:
        hidden = self.model(input_ids, attention_mask, position_ids).last_hidden_state
        return Output(logits=self.lm_head(hidden))

    def save_pretrained(self, out: str | Path, safe_serialization: bool = True) -> None:
        """config.json and model.safetensors as transformers writes them (a tied head left out;
        the source directory's generation_config.json kept)."""
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous().clone() for k, v in self.state_dict().items()
                 if not (self.config.tie_word_embeddings and k == "lm_head.weight")}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        src = Path(self.name_or_path) / "generation_config.json"
        if self.name_or_path and src.is_file() and src.resolve() != (out / src.name).resolve():
            (out / src.name).write_bytes(src.read_bytes())


def load_native_llama(path: str | Path, cfg: NativeLlamaConfig, dtype: torch.dtype,
                      device: torch.device) -> NativeLlamaForCausalLM:
    """The checkpoint at `path` in these modules (every weight the model has must be in the
    files; a tied head may be absent from them), in eval mode."""
    from safetensors.torch import load_file

    model = NativeLlamaForCausalLM(cfg)  # uninitialised storage, replaced below
    state: dict[str, Tensor] = {}
    for f in _weight_files(Path(path)):
        state.update(load_file(str(f)))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    own = {k for k, _ in model.named_parameters()}  # one name per tied tensor
    missing, unexpected = own - set(state), set(state) - own
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match a Llama of this config (missing "
                         f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.name_or_path = str(path)  # as an HF model says where it came from
    return model.to(device).eval()
