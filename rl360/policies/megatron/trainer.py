"""MegatronTrainer: the TorchTrainer interface over a megatron-core GPTModel.

It IS a TorchTrainer in everything but the model: the same micro-batching, the same policy
losses and reducers (global token / sequence denominators), the same metrics, old == current
logprobs, gradient sum over data-parallel ranks, clipping, AdamW + warm-up and checkpoint
state. What differs: the model is megatron's GPTModel (weights converted from the HF
checkpoint), logits come from megatron's forward with an explicit causal mask, and weights
leave it under HF names (`state_dict_for_sync`, `save`), so engines and `transformers` load
them unchanged.

Scope (honest): runs at TP = PP = CP = EP = 1, on CPU (megatron-core with `cpu_shims`) or on
one GPU per rank with plain torch AdamW. The recipe's parallel sizes are passed to megatron's
parallel_state, but loading weights into TP/PP shards, pipeline schedules and megatron's
distributed optimizer are not implemented; such a setup raises a clear error at start.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import Tensor

from rl360.policies.losses import PolicyLoss, build_policy_loss
from rl360.policies.megatron.convert import GPTShape, mcore_to_hf, shape_from_hf
from rl360.policies.megatron.model import (
    ParallelConfig,
    build_gpt,
    init_parallel,
    load_hf_into,
    mcore_state,
    on_gpu,
    read_hf_weights,
)
from rl360.policies.reducers import Reducer, build_reducer
from rl360.policies.trainer_torch import (
    _NOT_COPIED,
    _WEIGHT_SUFFIXES,
    STATE_FILE,
    TorchTrainer,
    TrainerConfig,
    _as_tuple,
    _MicroBatch,
)

_HF_CONFIG_FILES = ("config.json", "generation_config.json")


class MegatronTrainer(TorchTrainer):
    def __init__(self, config: TrainerConfig, model_path: str | Path,
                 parallel: ParallelConfig | None = None) -> None:
        from transformers import AutoConfig

        self.config = config
        self.model_path = Path(model_path)
        self.parallel = parallel or ParallelConfig()
        if self.parallel.model_parallel != 1:
            raise NotImplementedError(
                f"megatron backend: model parallelism {self.parallel} is not implemented yet "
                "(TP/PP weight sharding, pipeline schedule, distributed optimizer); "
                "use tensor/pipeline/context/expert_parallel = 1")
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        init_parallel(self.parallel, config.seed)
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
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=config.betas, eps=config.adam_eps,
            weight_decay=config.weight_decay, foreach=True,
        )
        warm = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0
        )
        self.loss_fn: PolicyLoss = build_policy_loss(config.loss)
        self.reducer: Reducer = build_reducer(config.loss.reducer, config.loss.norm_length)
        self.reference = None
        if self.loss_fn.needs_reference:
            self.reference = build_gpt(self.shape, self.parallel)
            load_hf_into(self.reference, hf_weights, self.shape)
            self.reference.train(False).requires_grad_(False)
        del hf_weights
        self.vocab = self.shape.vocab_size
        pad = getattr(hf_config, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else 0
        self.step = 0

    # ------------------------------------------------------------------ forward

    def _micro_batches(self, samples: list[Any]) -> Iterator[_MicroBatch]:
        for mb in super()._micro_batches(samples):
            if self.device.type == "cpu":
                yield mb
            else:
                yield _MicroBatch(*(t.to(self.device) for t in
                                    (mb.ids, mb.attn, mb.mask, mb.sampling, mb.adv)))

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.dtype == "bfloat16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _logits(self, model: Any, mb: _MicroBatch) -> Tensor:
        """Right-padded ids, causal attention (pads only follow real tokens, so they never
        change a real token's logits; their own positions are masked out of the loss)."""
        b, n = mb.ids.shape
        positions = torch.arange(n, device=self.device).unsqueeze(0).expand(b, n)
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).triu(1)[None, None]
        with self._autocast():
            logits = model(mb.ids, positions, causal)
        return logits[:, :-1].float() / self.config.temperature

    # ------------------------------------------------------------------ weights and state

    def state_dict_for_sync(self) -> dict[str, Tensor]:
        """Detached, contiguous CPU copies under the HF names (tied: lm_head IS the embedding)."""
        copies = {k: v.detach().to("cpu", copy=True).contiguous()
                  for k, v in mcore_state(self.model).items()}
        return mcore_to_hf(copies, self.shape)

    def save(self, out_dir: str | Path) -> Path:
        """HF safetensors + config + tokenizer files + trainer_state.pt (as TorchTrainer)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        hf = self.state_dict_for_sync()
        if self.shape.tied:
            del hf["lm_head.weight"]  # HF omits the tied head from the file
        tmp_weights = out / ".model.safetensors.tmp"
        save_file(hf, tmp_weights, metadata={"format": "pt"})
        tmp_weights.replace(out / "model.safetensors")
        for name, data in {**self._hf_files, **self._side_files}.items():
            if name in self._hf_files or not (out / name).exists():
                (out / name).write_bytes(data)
        state = {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "config": msgspec.to_builtins(self.config),
            "backend": "megatron",
        }
        tmp = out / f".{STATE_FILE}.tmp"
        torch.save(state, tmp)
        tmp.replace(out / STATE_FILE)
        return out

    def load(self, in_dir: str | Path) -> None:
        """Restore weights (HF safetensors), optimizer, scheduler, step and RNG state."""
        src = Path(in_dir)
        if not (src / STATE_FILE).is_file():
            raise FileNotFoundError(f"{src} has no {STATE_FILE}: not a trainer checkpoint")
        saved = json.loads((src / "config.json").read_text())
        if saved.get("model_type") != self.shape.family:
            raise ValueError(f"{src}: model_type {saved.get('model_type')!r}, this trainer "
                             f"runs {self.shape.family!r}")
        with torch.no_grad():
            load_hf_into(self.model, read_hf_weights(src), self.shape)
        state = torch.load(src / STATE_FILE, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(_as_tuple(state["python_rng"]))
