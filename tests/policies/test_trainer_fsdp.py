"""The fsdp trainer backend on CPUs (gloo): packed micro-batches give the padded torch
trainer's step for every reducer; 2 ranks (in-process, torch.multiprocessing) give the loss,
gradients and weights of 1 rank on the same batch, also when one rank has nothing to train;
a sharded checkpoint resumes to the identical next step; its HF export loads in transformers."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from rl360.actors.trainer_group import split_by_tokens
from rl360.policies.reducers import global_denominators
from rl360.policies.trainer_backends import build_trainer
from rl360.policies.trainer_torch import TorchTrainer
from rl360.recipe import LossSection, TrainerSection
from rl360.types import Batch, TrainSample
from tests.policies.conftest import random_samples

CFG = TrainerSection(backend="fsdp", lr=1e-3, micro_batch_size=3, micro_batch_tokens=60,
                     loss=LossSection(name="ppo", tis_cap=2.0))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _record_grads(trainer: Any) -> dict[str, torch.Tensor]:
    """Patch the optimizer step to keep the full (summed over ranks) gradients it applies."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        for name, p in trainer.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().clone()
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    return grads


def _batches() -> tuple[Batch, Batch]:
    b0 = random_samples(9, seed=11, max_len=40, noise=0.3)
    # two samples without a gradient: the rank they land on has less (or no) work
    b0 += [msgspec.structs.replace(s, advantage=0.0) for s in random_samples(2, seed=13)]
    return Batch(samples=b0, step=0), Batch(samples=random_samples(7, seed=12), step=1)


def _shards(batch: Batch, world: int) -> list[list[TrainSample]]:
    """Rank 0 every sample with a gradient, rank 1 only zero-advantage ones (all its
    micro-batches are empty), so the ranks' micro-batch counts differ."""
    if world == 1:
        return [batch.samples]
    live = [s for s in batch.samples if s.advantage != 0.0]
    return [live, [s for s in batch.samples if s.advantage == 0.0]]


def _rank_main(rank: int, world: int, port: int, model: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        trainer = build_trainer(CFG, model)
        b0, b1 = _batches()
        results: dict[str, Any] = {}
        grads = _record_grads(trainer)
        tokens, seqs = global_denominators(s.mask for s in b0.samples)
        shard = Batch(samples=_shards(b0, world)[rank], step=0)
        results["m0"] = trainer.train_step(shard, tokens, seqs)
        results["grads"] = dict(grads)
        results["w0"] = trainer.state_dict_for_sync() if rank == 0 else {}
        trainer.save(Path(out) / "ckpt")
        tokens, seqs = global_denominators(s.mask for s in b1.samples)
        part = Batch(samples=[b1.samples[i] for i in split_by_tokens([len(s.tokens) for s in b1.samples], world)[rank]])
        results["m1"] = trainer.train_step(part, tokens, seqs)
        results["w1"] = trainer.state_dict_for_sync() if rank == 0 else {}
        trainer.load(Path(out) / "ckpt")
        results["resumed_step"] = trainer.step
        results["m1_again"] = trainer.train_step(part, tokens, seqs)
        results["w1_again"] = trainer.state_dict_for_sync() if rank == 0 else {}
        if rank == 0:
            torch.save(results, Path(out) / "results.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_ranks(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp2")
    mp.spawn(_rank_main, args=(2, _free_port(), str(tiny_dir), str(out)), nprocs=2, join=True)
    return out, torch.load(out / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def one_rank(tiny_dir: Path) -> dict[str, Any]:
    """The plain torch trainer (padded micro-batches, one process) on the same batches."""
    torch.set_num_threads(1)
    t = TorchTrainer(CFG, tiny_dir)
    grads = _record_grads(t)
    b0, b1 = _batches()
    m0 = t.train_step(b0)
    res = {"m0": m0, "grads": dict(grads), "w0": t.state_dict_for_sync()}
    res["m1"] = t.train_step(b1)
    res["w1"] = t.state_dict_for_sync()
    return res


@pytest.fixture
def private_group() -> Iterator[None]:
    """The fsdp trainer on its own makes a 1-process group; leave none behind."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_two_ranks_step_like_one(two_ranks: tuple[Path, dict[str, Any]],
                                 one_rank: dict[str, Any]) -> None:
    _, two = two_ranks
    for key in ("loss", "grad_norm", "entropy", "mismatch_abs_max", "tokens", "seqs"):
        assert two["m0"][key] == pytest.approx(one_rank["m0"][key], rel=1e-5, abs=1e-6), key
    assert two["m0"]["zero_adv_skipped"] == 0.0  # rank 0's own count; rank 1 skipped 2
    assert _max_diff(two["grads"], one_rank["grads"]) < 1e-6
    assert max(float(g.abs().max()) for g in one_rank["grads"].values()) > 1e-3  # not vacuous
    assert _max_diff(two["w0"], one_rank["w0"]) < 1e-5
    assert two["m1"]["loss"] == pytest.approx(one_rank["m1"]["loss"], rel=1e-5, abs=1e-6)
    assert _max_diff(two["w1"], one_rank["w1"]) < 1e-5


def test_sharded_checkpoint_resumes_to_the_same_step(two_ranks: tuple[Path, dict[str, Any]]) -> None:
    out, two = two_ranks
    assert (out / "ckpt" / "fsdp").is_dir() and two["resumed_step"] == 1
    assert two["m1_again"]["loss"] == two["m1"]["loss"]
    assert two["m1_again"]["step"] == two["m1"]["step"] == 2.0
    assert _max_diff(two["w1_again"], two["w1"]) == 0.0


def test_export_loads_in_transformers(two_ranks: tuple[Path, dict[str, Any]]) -> None:
    out, two = two_ranks
    lm = AutoModelForCausalLM.from_pretrained(out / "ckpt", dtype=torch.float32)
    assert _max_diff(dict(lm.state_dict()), two["w0"]) == 0.0  # the weights after step 1
    assert lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()  # still tied


@pytest.mark.parametrize(("reducer", "steps"), [
    ("token-mean", 1), ("seq-mean-token-mean", 1), ("seq-mean-token-sum-norm", 1),
    ("token-mean", 2),  # 2 minibatches x 2 epochs: the proximal pass runs packed too
])
def test_packing_is_exact_for_every_reducer(tiny_dir: Path, private_group: None, reducer: str,
                                            steps: int) -> None:
    cfg = msgspec.structs.replace(CFG, loss=LossSection(name="gspo", reducer=reducer, kl_coef=0.1),
                                  minibatches=steps, epochs=steps)
    padded, packed = TorchTrainer(cfg, tiny_dir), build_trainer(cfg, tiny_dir)
    batch = Batch(samples=random_samples(8, seed=5, max_len=30, noise=0.3))
    grads = [_record_grads(t) for t in (padded, packed)]
    m = [t.train_step(batch) for t in (padded, packed)]
    for key in ("loss", "grad_norm", "kl"):
        assert m[1][key] == pytest.approx(m[0][key], rel=1e-5, abs=1e-7), key
    assert _max_diff(grads[1], grads[0]) < 1e-6  # the last optimizer step's
    assert m[1]["optimizer_steps"] == m[0]["optimizer_steps"] == steps * steps
    assert _max_diff(packed.state_dict_for_sync(), padded.state_dict_for_sync()) < 1e-5


def test_bf16_activation_checkpointing_trains(tiny_dir: Path, private_group: None) -> None:
    cfg = msgspec.structs.replace(CFG, dtype="bfloat16", gradient_checkpointing=True)
    t = build_trainer(cfg, tiny_dir)
    layers = t.model.model.layers
    assert all(getattr(m, "gradient_checkpointing", False) for m in layers) and len(layers) == 2
    before = t.state_dict_for_sync()
    m = t.train_step(Batch(samples=random_samples(6, seed=2)))
    assert m["skipped"] == 0.0 and m["grad_norm"] > 0
    assert all(v.dtype == torch.float32 for v in t.state_dict_for_sync().values())  # fp32 master
    assert _max_diff(t.state_dict_for_sync(), before) > 1e-4


def test_resume_refuses_a_torch_checkpoint(tiny_dir: Path, private_group: None, tmp_path: Path) -> None:
    TorchTrainer(CFG, tiny_dir).save(tmp_path / "torch")
    t = build_trainer(CFG, tiny_dir)
    with pytest.raises(FileNotFoundError, match="not an fsdp trainer checkpoint"):
        t.load(tmp_path / "torch")
