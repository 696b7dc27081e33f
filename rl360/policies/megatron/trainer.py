"""MegatronTrainer: the TorchTrainer interface over a megatron-core GPTModel.

It IS a TorchTrainer in everything but the model: the same micro-batching, the same policy
losses and reducers (global token / sequence denominators), the same metrics, old == current
logprobs, gradient sum over data-parallel ranks, clipping, AdamW + warm-up and checkpoint
state. What differs: the model is megatron's GPTModel (weights converted from the HF
checkpoint), logits come from megatron's forward with an explicit causal mask, and weights
leave it under HF names (`state_dict_for_sync`, `save`), so engines and `transformers` load
them unchanged.

Parallelism: data parallel (gradients summed over megatron's data-parallel group) and tensor
parallel (weights sliced per rank by `convert.shard_tp`, vocab-parallel logits gathered before
the loss, the grad norm summed over TP shards); both run on CPU over gloo and are tested there.
After every step the TP ranks gather the full weights once, so `state_dict_for_sync` and `save`
on any single rank need no collective. Not implemented (refused at start): pipeline, context and
expert parallel, and megatron's distributed optimizer (plain torch AdamW on each rank's slice;
megatron's optimizer hard-codes CUDA tensors, so it cannot run on this CPU tier).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rl360.policies.batching import MicroBatch
from rl360.policies.megatron.convert import GPTShape, mcore_to_hf, shape_from_hf
from rl360.policies.megatron.model import (
    ParallelConfig,
    build_gpt,
    gather_full_state,
    init_parallel,
    load_hf_into,
    on_gpu,
    read_hf_weights,
)
from rl360.policies.support import TRAINER_SUPPORT
from rl360.policies.trainer_state import STATE_FILE, as_tuple
from rl360.policies.trainer_torch import _NOT_COPIED, _WEIGHT_SUFFIXES, TorchTrainer
from rl360.recipe import TrainerSection

_HF_CONFIG_FILES = ("config.json", "generation_config.json")


class MegatronTrainer(TorchTrainer):
    fused_head_ok = False  # its output layer is vocabulary-parallel: `_logits` below

    def __init__(self, config: TrainerSection, model_path: str | Path, *,
                 temperature: float = 1.0, seed: int = 0) -> None:
        from transformers import AutoConfig

        self._init_common(config, model_path, temperature, seed)
        self.parallel = ParallelConfig.of(config)
        support = TRAINER_SUPPORT["megatron"]  # what `rl360 plan` checked the recipe against
        for key, size in (("tensor_parallel", self.parallel.tensor),
                          ("pipeline_parallel", self.parallel.pipeline),
                          ("context_parallel", self.parallel.context),
                          ("expert_parallel", self.parallel.expert)):
            if size > getattr(support, key):
                raise NotImplementedError(
                    f"trainer.megatron.{key}={size}: the megatron backend supports at most "
                    f"{getattr(support, key)} ({support.notes})")
        init_parallel(self.parallel, seed)
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")
        hf_config = AutoConfig.from_pretrained(self.model_path)
        self.shape: GPTShape = shape_from_hf(hf_config)
        self._hf_files = {n: (self.model_path / n).read_bytes() for n in _HF_CONFIG_FILES
                          if (self.model_path / n).is_file()}
        self._side_files = {
            f.name: f.read_bytes() for f in self.model_path.iterdir()
            if f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(_WEIGHT_SUFFIXES)
        }
        hf_weights = read_hf_weights(self.model_path)
        self.model = build_gpt(self.shape, self.parallel)
        load_hf_into(self.model, hf_weights, self.shape)
        self.model.train(False)  # dropout is 0 anyway; old == current must hold exactly
        if config.gradient_checkpointing:
            raise NotImplementedError("megatron backend: gradient_checkpointing is not wired "
                                      "(megatron's recompute_granularity)")
        self._setup_optimization(config)
        if self.loss_fn.needs_reference:
            self.reference = build_gpt(self.shape, self.parallel)
            load_hf_into(self.reference, hf_weights, self.shape)
            self.reference.train(False).requires_grad_(False)
        del hf_weights
        self.vocab = self.shape.vocab_size
        pad = getattr(hf_config, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else 0
        self.step = 0
        self._full: dict[str, Tensor] | None = None  # gathered weights (TP > 1), per step
        self._refresh_full()

    # ------------------------------------------------------------------ parallel layout

    @property
    def tensor_parallel(self) -> int:
        return self.parallel.tensor

    @property
    def tp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank()

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    @property
    def dp_group(self) -> Any:
        if self.parallel.tensor == 1:
            return None  # data parallel over every rank: the default group
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def _refresh_full(self) -> None:
        """With TP > 1: gather the full weights (a TP collective) so that sync and save on
        one rank need no other rank."""
        if self.parallel.tensor > 1:
            self._full = gather_full_state(self.model)

    def train_step(
        self, batch: Any, global_tokens: int | None = None, global_seqs: int | None = None
    ) -> dict[str, float]:
        metrics = super().train_step(batch, global_tokens, global_seqs)
        self._refresh_full()
        return metrics

    def _clip(self) -> Tensor:
        """As TorchTrainer, with the norm of TP-sliced parameters summed over the TP group
        (replicated ones, the norms, counted once)."""
        if self.parallel.tensor == 1:
            return super()._clip()
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        sliced = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for p in self.params:
            if p.grad is None:
                continue
            grads.append(p.grad)
            sq = p.grad.detach().double().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                sliced += sq
            else:
                replicated += sq
        dist.all_reduce(sliced, group=ps.get_tensor_model_parallel_group())
        norm = (sliced + replicated).sqrt().float()
        if self.config.grad_clip > 0 and grads:
            coef = torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return norm

    # ------------------------------------------------------------------ forward

    def _logits(self, model: Any, mb: MicroBatch) -> Tensor:
        """Right-padded ids, causal attention (pads only follow real tokens, so they never
        change a real token's logits; their own positions are masked out of the loss)."""
        b, n = mb.ids.shape
        positions = torch.arange(n, device=self.device).unsqueeze(0).expand(b, n)
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).triu(1)[None, None]
        with self._autocast():
            logits = model(mb.ids, positions, causal)
        if self.parallel.tensor > 1:  # vocab-parallel: each rank holds a slice of the vocab
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits)
        return logits[:, :-1].float() / self.temperature

    # ------------------------------------------------------------------ weights and state

    def state_dict_for_sync(self) -> dict[str, Tensor]:
        """Detached, contiguous CPU copies under the HF names (tied: lm_head IS the embedding)."""
        full = self._full if self._full is not None else gather_full_state(self.model)
        return mcore_to_hf(dict(full), self.shape)

    def _state_file(self) -> str:
        """TP rank 0 keeps TorchTrainer's file name; rank r > 0 its own optimizer slice."""
        r = self.tp_rank
        return STATE_FILE if r == 0 else STATE_FILE.replace(".pt", f".tp{r}.pt")

    def save(self, out_dir: str | Path) -> Path:
        """HF safetensors + config + tokenizer files + trainer_state.pt (as TorchTrainer).
        With TP > 1 every rank of one data-parallel replica calls it: TP rank 0 writes the
        model, each TP rank its optimizer slice (trainer_state.tp<r>.pt)."""

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.tp_rank == 0:
            self._save_model(out)
        state = {**self._train_state(), "backend": "megatron",
                 "tensor_parallel": self.parallel.tensor}
        self._write_state(out / self._state_file(), state)
        return out

    def _save_model(self, out: Path) -> None:
        from safetensors.torch import save_file

        hf = self.state_dict_for_sync()
        if self.shape.tied:
            del hf["lm_head.weight"]  # HF omits the tied head from the file
        tmp_weights = out / ".model.safetensors.tmp"
        save_file(hf, tmp_weights, metadata={"format": "pt"})
        tmp_weights.replace(out / "model.safetensors")
        for name, data in {**self._hf_files, **self._side_files}.items():
            if name in self._hf_files or not (out / name).exists():
                (out / name).write_bytes(data)

    def load(self, in_dir: str | Path) -> None:
        """Restore weights (HF safetensors), optimizer, scheduler, step and RNG state."""
        src = Path(in_dir)
        name = self._state_file()
        if not (src / name).is_file():
            raise FileNotFoundError(f"{src} has no {name}: not a trainer checkpoint of this "
                                    f"tensor-parallel layout ({self.parallel.tensor})")
        saved = json.loads((src / "config.json").read_text())
        if saved.get("model_type") != self.shape.family:
            raise ValueError(f"{src}: model_type {saved.get('model_type')!r}, this trainer "
                             f"runs {self.shape.family!r}")
        with torch.no_grad():
            load_hf_into(self.model, read_hf_weights(src), self.shape)
        state = torch.load(src / name, map_location="cpu", weights_only=True)
        if state.get("backend") != "megatron" or state.get("tensor_parallel", 1) != self.parallel.tensor:
            raise ValueError(f"{src}/{name}: optimizer state of backend {state.get('backend')!r}"
                             f" with tensor_parallel {state.get('tensor_parallel', 1)}; this "
                             f"trainer is megatron with tensor_parallel {self.parallel.tensor}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(as_tuple(state["python_rng"]))
        self._refresh_full()
