"""The fsdp trainer backend: the torch trainer with its model sharded by PyTorch FSDP2
(`torch.distributed.fsdp.fully_shard`, one unit per decoder layer plus the root).

Everything that defines the step is the torch trainer's (`TorchTrainer`: losses, reducers,
AdamW + warm-up, metrics, validation); this class changes where the weights live and how a
micro-batch reaches the model:

- Sharding: every rank holds 1/W of each parameter, its gradient and its AdamW state.
  Gradients are reduce-scattered in the backward with the divide factor 1 (a SUM: the reducers'
  global denominators already make the sum the global batch's gradient), so W ranks take the
  step one rank takes on the whole batch.
- Mixed precision: `trainer.dtype = "bfloat16"` computes in bf16 (MixedPrecisionPolicy
  param_dtype) and reduces gradients in fp32; the sharded master weights stay fp32.
- Activation checkpointing: `gradient_checkpointing` (non-reentrant, inside each layer unit).
- Sequence packing: a micro-batch is one row of its sequences back to back (position ids
  restarting per sequence, the model's block-diagonal causal mask), no padding; per-token
  values are unpacked into the padded [B, L-1] layout before the loss and reducer, so every
  reducer is exactly the one the padded path computes. `micro_batch_tokens` caps the real
  tokens of a pack. Ranks agree on the number of micro-batches (a rank with fewer runs empty
  ones with zero loss): FSDP's all-gathers need every rank in every forward.
- Weights for the engines: after each step (and at start / load) the full parameters are
  gathered (`DTensor.full_tensor`) and rank 0 keeps a CPU copy, so `state_dict_for_sync` on
  rank 0 needs no collective (the trainer group and the weight transports ask rank 0 only).
  With `full_copy=False` (sharded weight sync, `train.weight_sync.sharded`) nothing is
  gathered: every rank sends its own shards (`held_weights`, rl360.weights.shards), and the
  full weights exist only while `save` writes the HF export or `gather_full` is asked for.
- Checkpoints: `save` is collective (`collective_checkpoint`): model and optimizer shards go
  to `<dir>/fsdp` with torch.distributed.checkpoint (resume: `load` on every rank, same W),
  and rank 0 writes an HF safetensors export (+ config, tokenizer files, trainer_state.pt) in
  `<dir>` that the engines and `transformers` load.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from huggingface_hub import save_torch_state_dict
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from rl360.policies.lora import adapter_state, is_lora_key, merged_state, save_adapter
from rl360.policies.trainer_torch import STATE_FILE, MicroBatch, StepMetrics, TorchTrainer
from rl360.recipe import TrainerSection
from rl360.types import Batch, TrainSample

SHARDS_DIR = "fsdp"  # torch.distributed.checkpoint shards inside a checkpoint directory


class FSDPTrainer(TorchTrainer):
    """`TorchTrainer` with FSDP2-sharded weights, gradients and optimizer state."""

    collective_checkpoint = True  # every rank takes part in save (the trainer group asks all)
    native_model_ok = False  # transformers' model: FSDP2 wraps its decoder layers
    fused_head_ok = False  # the head's weight is a shard outside its module's forward

    def __init__(self, config: TrainerSection, model_path: str | Path, *,
                 full_copy: bool = True, **kwargs: Any) -> None:
        """As `TorchTrainer` (the trainer group's process group is the FSDP group).
        `full_copy=False`: keep no gathered copy of the weights (sharded weight sync)."""
        self.full_copy = full_copy
        if not dist.is_initialized():  # one rank on its own: a private 1-process group
            gpu = config.device != "cpu" and config.num_gpus > 0 and torch.cuda.is_available()
            dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo",
                                    store=dist.HashStore(), rank=0, world_size=1)
        super().__init__(config, model_path, **kwargs)
        if not full_copy and self.lora is not None:
            raise ValueError("sharded weight sync sends full weights: it does not take "
                             "trainer.lora (adapter versions go through rank 0)")
        self._full: dict[str, Tensor] = self._gather() if full_copy else {}

    # ------------------------------------------------------------------ sharding

    def _load_pretrained(self, path: Path | None = None) -> Any:
        """Rank 0 reads the weights; the other ranks build the model on the meta device (no
        memory) and receive their shards from rank 0 in `_place`."""
        if self.rank == 0:
            return super()._load_pretrained(path)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path),
                                                    dtype=torch.float32)

    def _place(self, model: Any) -> Any:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        full = model.state_dict() if self.rank == 0 else {}  # rank 0's weights, before sharding
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        bf16 = self.config.dtype == "bfloat16"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.float32)
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        for module in list(model.modules()):
            if type(module).__name__ in blocks:
                fully_shard(module, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # sum over ranks, never the mean; a plain SUM (gloo has no PREMUL_SUM)
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        if self.rank != 0:
            model.to_empty(device=self.device)
        else:
            model.to(self.device)  # buffers FSDP does not manage (e.g. rotary frequencies)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                    broadcast_from_rank0=True))
        for buf in model.buffers():  # non-persistent buffers are in no state dict
            dist.broadcast(buf, src=0)
        return model

    def _all_reduce_grads(self) -> None:
        """Nothing to do: the backward already reduce-scattered (summed) every gradient."""

    def _clip(self) -> Tensor:
        norm = super()._clip()  # clip_grad_norm_ over sharded grads: the global norm
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # ------------------------------------------------------------------ packed micro-batches

    def _packs(self, samples: list[TrainSample]) -> Iterator[list[TrainSample]]:
        """Longest first; at most micro_batch_size sequences and, when micro_batch_tokens > 0,
        that many real tokens per pack (a longer sequence is a pack of its own)."""
        size, budget = self.config.micro_batch_size, self.config.micro_batch_tokens
        pack: list[TrainSample] = []
        tokens = 0
        for s in sorted(samples, key=lambda s: -len(s.tokens)):
            if pack and (len(pack) >= size or (budget and tokens + len(s.tokens) > budget)):
                yield pack
                pack, tokens = [], 0
            pack.append(s)
            tokens += len(s.tokens)
        if pack:
            yield pack

    def _pack(self, pack: list[TrainSample], proximal: dict[int, Tensor] | None,
              index: dict[int, int] | None) -> MicroBatch:
        lens = [len(s.tokens) for s in pack]
        width = max(lens)
        ids = torch.tensor([t for s in pack for t in s.tokens], dtype=torch.long).unsqueeze(0)
        positions = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
        mask = torch.zeros((len(pack), width - 1), dtype=torch.float32)
        samp = torch.zeros((len(pack), width - 1), dtype=torch.float32)
        # target j of sequence r (token j+1) is packed target offset_r + j; a sequence's last
        # packed target (the next sequence's first token) is never read
        unpack = torch.zeros((len(pack), width - 1), dtype=torch.long)
        offset = 0
        for r, s in enumerate(pack):
            n = lens[r]
            mask[r, : n - 1] = torch.tensor(s.mask[1:], dtype=torch.float32)
            samp[r, : n - 1] = torch.tensor(s.sampling_logprobs[1:], dtype=torch.float32)
            unpack[r, : n - 1] = torch.arange(offset, offset + n - 1)
            offset += n
        adv = torch.tensor([s.advantage for s in pack], dtype=torch.float32)
        old, rows = self._proximal_rows(pack, width, proximal, index)
        return MicroBatch(ids, None, mask, samp, adv, old, rows, positions,
                           unpack).to(self.device)

    def _empty(self) -> MicroBatch:
        """A 2-token micro-batch without loss tokens, for a rank that ran out of work."""
        z = torch.zeros((1, 1))
        return MicroBatch(torch.full((1, 2), self.pad_id, dtype=torch.long), None, z, z,
                           torch.zeros(1), None, [], torch.arange(2).unsqueeze(0),
                           torch.zeros((1, 1), dtype=torch.long)).to(self.device)

    def _micro_batches(self, samples: list[TrainSample], proximal: dict[int, Tensor] | None = None,
                       index: dict[int, int] | None = None) -> Iterator[MicroBatch]:
        """Packed micro-batches (`proximal`, `index`: as TorchTrainer's), then empty ones up
        to the most any rank has: every forward (also the proximal scoring pass) runs on all
        ranks."""
        packs = list(self._packs(samples))
        count = torch.tensor([len(packs)], dtype=torch.long, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        for p in packs:
            yield self._pack(p, proximal, index)
        for _ in range(int(count) - len(packs)):
            yield self._empty()

    def _forward_backward(
        self, mb: MicroBatch, acc: StepMetrics, global_tokens: int, global_seqs: int
    ) -> Tensor:
        if float(mb.mask.sum()) > 0:
            return super()._forward_backward(mb, acc, global_tokens, global_seqs)
        # no loss tokens here: still run every forward and backward the other ranks run
        if self.reference is not None:
            with torch.no_grad(), self._reference_scope():
                self._logits(self.reference, mb)
        (self._logits(self.model, mb).sum() * 0.0).backward()
        return torch.zeros((), dtype=torch.float64)

    # ------------------------------------------------------------------ weights and state

    def train_step(
        self, batch: Batch, global_tokens: int | None = None, global_seqs: int | None = None
    ) -> dict[str, float]:
        metrics = super().train_step(batch, global_tokens, global_seqs)
        self._full = {}  # drop the old copy before gathering the new one
        if self.full_copy:
            self._full = self._gather()
        return metrics

    def held_weights(self) -> dict[str, Tensor]:
        """This rank's weights as it holds them: name -> DTensor (its dim-0 shard) under the
        HF names, tied weights one object under both names (rl360.weights.shards)."""
        return dict(self.model.state_dict(keep_vars=True))

    def gather_full(self) -> int:
        """Collective: gather the full weights into rank 0's copy now (what every step does
        with `full_copy`); returns its bytes on rank 0 (0 elsewhere)."""
        self._full = {}
        self._full = self._gather()
        return sum(t.numel() * t.element_size() for t in self._full.values())

    def drop_full(self) -> None:
        """Let the gathered copy go (`full_copy=False`: until the next gather_full)."""
        if not self.full_copy:
            self._full = {}

    def _gather(self) -> dict[str, Tensor]:
        """Every rank gathers each full parameter in turn; rank 0 keeps CPU copies under the
        HF names (tied weights share one copy). Collective. With adapters the frozen base is
        gathered once and kept; later gathers fetch the adapter tensors only."""
        keep = self.rank == 0
        base = getattr(self, "_base", None)
        out: dict[str, Tensor] = dict(base) if base is not None else {}
        seen: dict[int, Tensor | None] = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            if base is not None and not is_lora_key(name):
                continue
            if id(t) not in seen:
                full = t.full_tensor() if isinstance(t, DTensor) else t
                seen[id(t)] = full.detach().to("cpu", copy=True).contiguous() if keep else None
            copy = seen[id(t)]
            if copy is not None:
                out[name] = copy
        if self.lora is not None and base is None:
            self._base = {k: v for k, v in out.items() if not is_lora_key(k)}
        return out

    def state_dict_for_sync(self) -> dict[str, Tensor]:
        """The full weights after the latest step (rank 0 only, no collective)."""
        if self.rank != 0:
            raise RuntimeError("fsdp trainer: only rank 0 holds the gathered weights for sync")
        if not self._full:
            raise RuntimeError("fsdp trainer with sharded weight sync keeps no gathered copy: "
                               "every rank sends its shards (gather_full gathers one)")
        if self.lora is not None:
            return merged_state(self._full, self.lora.scaling)
        return dict(self._full)

    def adapter_for_sync(self) -> dict[str, Tensor]:
        """The adapter tensors after the latest step (rank 0 only, no collective)."""
        if self.rank != 0 or self.lora is None:
            raise RuntimeError("fsdp trainer: adapters for sync are rank 0's, with trainer.lora")
        return adapter_state(self._full)

    def _model_state(self) -> dict[str, Any]:
        """The model's part of a sharded checkpoint: with adapters the adapters alone (the
        frozen base is the model path's)."""
        opts = StateDictOptions(ignore_frozen_params=self.lora is not None)
        return get_model_state_dict(self.model, options=opts)

    def save(self, out_dir: str | Path) -> Path:
        """Collective: every rank writes its shards to <out_dir>/fsdp; rank 0 the HF export."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {"model": self._model_state()}
        if self.optimizer.state:  # no step yet: nothing to save (and DCP would invent one)
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        dcp.save(state, checkpoint_id=out / SHARDS_DIR)
        # without a kept copy every rank gathers for rank 0's export (a collective), then
        # it is let go
        full = self._full if self.full_copy else self._gather()
        if self.rank == 0 and self.lora is not None:
            save_adapter(out, adapter_state(full), self.lora,
                         str(self.model_path.resolve()))
        elif self.rank == 0:
            save_torch_state_dict(full, out, max_shard_size="5GB")
            self.model.config.save_pretrained(out)
            if getattr(self.model, "generation_config", None) is not None:
                self.model.generation_config.save_pretrained(out)
        del full
        if self.rank == 0:
            for name, data in self._side_files.items():
                if not (out / name).exists():
                    (out / name).write_bytes(data)
            train_state = self._train_state()
            train_state["optimizer"] = "optim" in state  # the state itself is in the shards
            self._write_state(out / STATE_FILE, train_state)
        dist.barrier()
        return out

    def load(self, in_dir: str | Path) -> None:
        """Collective: restore shards (model + optimizer), scheduler, step and RNG state."""
        src = Path(in_dir)
        if not (src / STATE_FILE).is_file() or not (src / SHARDS_DIR).is_dir():
            raise FileNotFoundError(f"{src} has no {STATE_FILE} and {SHARDS_DIR}/: not an fsdp "
                                    "trainer checkpoint (resume with the backend that wrote it)")
        train_state = torch.load(src / STATE_FILE, map_location="cpu", weights_only=True)
        state: dict[str, Any] = {"model": self._model_state()}
        if train_state["optimizer"]:
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        dcp.load(state, checkpoint_id=src / SHARDS_DIR)
        set_model_state_dict(self.model, state["model"],
                             options=StateDictOptions(strict=self.lora is None))
        if "optim" in state:
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        self._restore_train_state(train_state)
        self._full = {}
        if self.full_copy:
            self._full = self._gather()
