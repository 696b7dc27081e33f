"""The torch engine's forward pass: a Llama-shaped HF causal LM run over a slot KV cache.

The engine owns the KV cache (as vLLM and SGLang do) instead of handing HF a DynamicCache:
`SlotKV` holds, per layer, K and V as [slots, kv_heads, capacity, head_dim]; each running
sequence owns one slot (rows are kept packed at the front, so a forward over rows a..b reads
a plain view). `forward` runs any number of rows, each with its own start position and query
length (a decode step is every row with one query; a prefill is new rows with their prompt
suffixes, right-padded), writes their K/V into the slots and returns the last valid query's
logits per row. It calls the model's own modules (projections, norms, rotary embedding,
MLP), so weights loaded into the model are what it runs: an HF model, or the same module tree
built without transformers' modeling code (native_llama.py, for plain Llama checkpoints).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rl360.policies.native_llama import apply_rotary_pos_emb

# HF model types whose decoder layers have the Llama shape (q/k/v/o projections, RoPE,
# pre-norm attention and MLP; qwen3 adds per-head q/k norms, qwen2 projection biases)
LLAMA_SHAPED = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def check_supported(model: Any) -> None:
    kind = getattr(model.config, "model_type", "?")
    if kind not in LLAMA_SHAPED:
        raise ValueError(
            f"torch engine: model type {kind!r} is not supported (Llama-shaped models only: "
            f"{', '.join(sorted(LLAMA_SHAPED))}); serve it with engine.backend = 'vllm' or 'sglang'"
        )


class SlotKV:
    """K and V per layer for up to `slots` sequences, grown on demand (zeros: masked
    positions must hold finite numbers, or 0 x NaN would poison the softmax)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        self.layers, self.kv_heads, self.head_dim, self.dtype = layers, kv_heads, head_dim, dtype
        self.device = device or torch.device("cpu")
        self.slots = 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def ensure(self, slots: int, length: int) -> None:
        if slots <= self.slots and length <= self.capacity:
            return
        new_slots = max(self.slots, _pow2(slots))
        new_cap = max(self.capacity, _pow2(max(length, 64)))
        shape = (new_slots, self.kv_heads, new_cap, self.head_dim)
        for store in (self.k, self.v):
            for i in range(self.layers):
                t = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if store and self.slots:
                    t[: self.slots, :, : self.capacity] = store[i]
                if len(store) > i:
                    store[i] = t
                else:
                    store.append(t)
        self.slots, self.capacity = new_slots, new_cap

    def release(self) -> None:
        self.k, self.v, self.slots, self.capacity = [], [], 0, 0

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src`'s first `length` positions into slot `dst` (row compaction)."""
        for store in (self.k, self.v):
            for t in store:
                t[dst, :, :length] = t[src, :, :length]

    def export(self, slot: int, length: int) -> torch.Tensor:
        """A copy of one slot's first `length` positions: [layers, 2, kv_heads, length, dim]."""
        return torch.stack([torch.stack([k[slot, :, :length], v[slot, :, :length]])
                            for k, v in zip(self.k, self.v, strict=True)])

    def load(self, slot: int, kv: torch.Tensor, length: int) -> None:
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k[slot, :, :length] = kv[i, 0, :, :length].to(self.device)
            v[slot, :, :length] = kv[i, 1, :, :length].to(self.device)


class LlamaRunner:
    """The forward pass over slots for one HF model (holds references to its modules)."""

    def __init__(self, model: Any) -> None:
        check_supported(model)
        cfg = model.config
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers[: cfg.num_hidden_layers])
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.kv = SlotKV(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device)
        # RoPE types whose angles depend on the position only are tabulated once
        rope = getattr(self.inner.rotary_emb, "rope_type", "default")
        self._rope_table = rope in ("default", "linear", "llama3", "yarn")
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def kv_bytes_per_token(self) -> int:
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @torch.inference_mode()
    def forward(self, first_slot: int, tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Rows `first_slot..first_slot+len(tokens)-1`; row i feeds `tokens[i]` at positions
        `starts[i]...`. Returns float32 logits [rows, vocab] of each row's last token, on the
        CPU (where sampling runs, with each request's own CPU generator)."""
        n = len(tokens)
        lens = [len(t) for t in tokens]
        q = max(lens)
        dev = self.device
        qlens = torch.tensor(lens, device=dev)
        ids = torch.tensor([t + [0] * (q - len(t)) for t in tokens] if q > 1 else tokens, device=dev)
        start = torch.tensor(starts, device=dev)
        pos = start[:, None] + torch.arange(q, device=dev)[None, :]  # [n, q]
        kmax = max(s + n_ for s, n_ in zip(starts, lens, strict=True))
        self.kv.ensure(first_slot + n, max(starts) + q)
        mask = (torch.arange(kmax, device=dev)[None, None, :] <= pos[:, :, None]).unsqueeze(1)
        rows = slice(first_slot, first_slot + n)
        widx = (torch.arange(n, device=dev)[:, None, None],
                torch.arange(self.kv_heads, device=dev)[None, :, None], pos[:, None, :])
        x = self.inner.embed_tokens(ids)
        cos, sin = self._rope(x, pos, max(starts) + q)
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            qs = attn.q_proj(h).view(n, q, -1, self.head_dim)
            ks = attn.k_proj(h).view(n, q, -1, self.head_dim)
            vs = attn.v_proj(h).view(n, q, -1, self.head_dim)
            if hasattr(attn, "q_norm"):  # qwen3
                qs, ks = attn.q_norm(qs), attn.k_norm(ks)
            qs, ks = apply_rotary_pos_emb(qs.transpose(1, 2), ks.transpose(1, 2), cos, sin)
            kc, vc = self.kv.k[li][rows], self.kv.v[li][rows]
            kc.index_put_(widx, ks)
            vc.index_put_(widx, vs.transpose(1, 2))
            o = F.scaled_dot_product_attention(
                qs, kc[:, :, :kmax], vc[:, :, :kmax], attn_mask=mask, scale=attn.scaling,
                enable_gqa=self.kv_heads != self.heads,
            )
            x = x + attn.o_proj(o.transpose(1, 2).reshape(n, q, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = x[torch.arange(n, device=dev), qlens - 1]
        return self.model.lm_head(self.inner.norm(last)).float().cpu()

    def _rope(self, x: torch.Tensor, pos: torch.Tensor, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._rope_table:
            return self.inner.rotary_emb(x, pos)  # type: ignore[no-any-return]
        if self._cos is None or self._cos.shape[0] < need:
            table = torch.arange(_pow2(max(need, 256)), device=self.device)[None]
            cos, sin = self.inner.rotary_emb(x[:1, :1], table)
            self._cos, self._sin = cos[0], sin[0]
        assert self._sin is not None
        return self._cos[pos], self._sin[pos]


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p
