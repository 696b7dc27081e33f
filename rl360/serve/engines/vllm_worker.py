"""The vLLM worker extension RL360 installs (`worker_extension_cls`): it runs inside vLLM's
engine-core process, where the model lives, and is reached with `collective_rpc`.

Kept free of heavy imports at module level: vLLM imports it by qualified name in every
worker process.
"""

from __future__ import annotations

import io
from typing import Any


class RL360WeightLoader:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def rl360_load_weights(self, payload: bytes) -> int:
        """Reload the running model in place from a name -> tensor dict (HF names, as the
        trainer's state dict has them; `torch.save`d to bytes by `pack_state`, since vLLM's
        RPC encoder does not carry tensors inside a dict). vLLM's own in-place reload maps
        HF names onto its fused parameters (qkv_proj, gate_up_proj, ...) and redoes the
        platform's post-load processing (the CPU backend repacks linear weights, so a plain
        `load_weights` after start-up fails). Returns the number of tensors loaded."""
        state = unpack_state(payload)
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=iter(state.items()), is_checkpoint_format=True
        )
        self._rl360_refresh_tied_head()
        return len(state)

    def _rl360_refresh_tied_head(self) -> None:
        """With tied embeddings the LM head receives no tensor of its own, so vLLM's reload
        leaves it as it was; on CPU its matmul runs from a copy packed at start-up (oneDNN),
        which then still holds the old embedding. Re-point it at the embedding and redo its
        post-load processing (a no-op on GPUs)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)  # Llama, Qwen2
        if head is None or embed is None or not getattr(config, "tie_word_embeddings", False):
            return
        if head.weight.data_ptr() != embed.weight.data_ptr():
            head.weight.data.copy_(embed.weight.data)
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)


def pack_state(state: dict[str, Any]) -> bytes:

    import torch

    buf = io.BytesIO()
    torch.save({k: torch.as_tensor(v).detach().contiguous() for k, v in state.items()}, buf)
    return buf.getvalue()


def unpack_state(payload: bytes) -> dict[str, Any]:

    import torch

    state = torch.load(io.BytesIO(payload), weights_only=True)
    if not isinstance(state, dict):
        raise TypeError(f"weight payload holds {type(state).__name__}, not a name -> tensor dict")
    return state
