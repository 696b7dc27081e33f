"""Trainer backends by name: `build_trainer(config, model_path, temperature=, seed=)`.

Every backend implements the `Trainer` protocol of `TorchTrainer` (the contract); the recipe's
`trainer.backend` picks one from `TRAINER_BACKENDS`. The megatron backend needs megatron-core
(the `megatron` extra) and is imported only when chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from rl360.policies.trainer_torch import TorchTrainer
from rl360.recipe import TrainerSection
from rl360.types import Batch


class Trainer(Protocol):
    step: int
    params: list[Any]

    def train_step(self, batch: Batch, global_tokens: int | None = None,
                   global_seqs: int | None = None) -> dict[str, float]: ...

    def state_dict_for_sync(self) -> dict[str, Tensor]: ...

    def save(self, out_dir: str | Path) -> Path: ...

    def load(self, in_dir: str | Path) -> None: ...


TrainerFactory = Callable[..., Trainer]


def _torch(config: TrainerSection, model_path: str | Path, *, temperature: float,
           seed: int) -> Trainer:

    # data parallel only: the support checks refuse tensor/pipeline parallel sizes for it
    return TorchTrainer(config, model_path, temperature=temperature, seed=seed)


def _fsdp(config: TrainerSection, model_path: str | Path, *, temperature: float,
          seed: int, full_copy: bool = True) -> Trainer:
    from rl360.policies.trainer_fsdp import FSDPTrainer

    # FSDP2 over every rank of the trainer group (data parallel, sharded)
    return FSDPTrainer(config, model_path, temperature=temperature, seed=seed,
                       full_copy=full_copy)


def _megatron(config: TrainerSection, model_path: str | Path, *, temperature: float,
              seed: int) -> Trainer:
    try:
        import megatron.core  # noqa: F401

        from rl360.policies.megatron.trainer import MegatronTrainer
    except ImportError as exc:
        raise ImportError("trainer.backend='megatron' needs megatron-core: "
                          "pip install --no-deps 'megatron-core==0.16.0' "
                          f"(or `make test-megatron`); import failed: {exc}") from exc
    return MegatronTrainer(config, model_path, temperature=temperature, seed=seed)


TRAINER_BACKENDS: dict[str, TrainerFactory] = {"torch": _torch, "fsdp": _fsdp, "megatron": _megatron}

# backends whose every rank can send the weights it holds (train.weight_sync.sharded,
# rl360.weights.shards): fsdp its shards, torch (replicated) a share of the tensors; megatron
# sends through rank 0's tensor-parallel gather
SHARDED_SYNC = ("torch", "fsdp")


def build_trainer(config: TrainerSection, model_path: str | Path, *, temperature: float = 1.0,
                  seed: int = 0, sharded_sync: bool = False) -> Trainer:
    """The trainer of `config.backend` (the recipe's [trainer] section). `sharded_sync`: every
    rank sends its own weights (an fsdp trainer then keeps no gathered copy)."""
    factory = TRAINER_BACKENDS.get(config.backend)
    if factory is None:
        raise ValueError(f"trainer backend {config.backend!r} not in {sorted(TRAINER_BACKENDS)}")
    if sharded_sync and config.backend not in SHARDED_SYNC:
        raise ValueError(f"train.weight_sync.sharded: trainer backend {config.backend!r} sends "
                         f"through rank 0; sharded senders need one of {list(SHARDED_SYNC)}")
    extra = {"full_copy": False} if sharded_sync and config.backend == "fsdp" else {}
    return factory(config, model_path, temperature=temperature, seed=seed, **extra)
