"""Device selection for the torch engine and trainers (rl360.policies.devices): recipe
num_gpus + dtype + the CUDA devices a process sees -> torch device and dtype; clear errors."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl360.policies.devices import place_for_generation, select_device
from rl360.policies.trainer_torch import TorchTrainer
from rl360.recipe import EngineSection, ModelSection, TrainerSection
from rl360.serve.engines.torch_backend import TorchBackend, load_causal_lm
from rl360.types import Batch, SamplingParams

TRAINER = {"gpus_key": "trainer.num_gpus", "dtype_key": "trainer.dtype"}
ENGINE = {"gpus_key": "engine.num_gpus", "dtype_key": "model.dtype"}
no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: needs a CUDA device")


def test_no_gpus_is_the_cpu_whatever_is_visible() -> None:
    for visible in (0, 8):
        p = select_device(0, "float32", cuda_devices=visible, **TRAINER)
        assert p.device == torch.device("cpu") and p.dtype == torch.float32 and not p.cuda
    assert select_device(0, "bfloat16", cuda_devices=0, **ENGINE).dtype == torch.bfloat16


def test_reserved_gpu_is_cuda_0_in_the_asked_dtype() -> None:
    # Ray narrows CUDA_VISIBLE_DEVICES to the reserved GPUs: the process's first is ours,
    # also for a fractional share of one GPU
    for num_gpus in (1, 0.25, 4):
        p = select_device(num_gpus, "bfloat16", cuda_devices=4, **ENGINE)
        assert p.device == torch.device("cuda", 0) and p.dtype == torch.bfloat16 and p.cuda


def test_gpus_reserved_but_none_visible_names_the_key() -> None:
    with pytest.raises(RuntimeError, match=r"trainer\.num_gpus = 1 .*no CUDA device"):
        select_device(1, "float32", cuda_devices=0, **TRAINER)
    with pytest.raises(ValueError, match=r"model\.dtype 'fp8'"):
        select_device(0, "fp8", cuda_devices=0, **ENGINE)
    with pytest.raises(ValueError, match=r"engine\.num_gpus must be >= 0"):
        select_device(-1, "float32", cuda_devices=1, **ENGINE)


def test_cpu_placement_only_casts(tiny_dir: Path) -> None:
    lm = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    placed = place_for_generation(lm, select_device(0, "bfloat16", cuda_devices=0, **ENGINE))
    assert placed is lm and next(lm.parameters()).dtype == torch.bfloat16
    ids = torch.tensor([[1, 2, 3]])
    assert placed(input_ids=ids).logits.shape[1] == 3  # no hooks: every position's logits


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a CPU-only host")
def test_trainer_and_engine_refuse_gpus_they_cannot_see(tiny_dir: Path) -> None:
    with pytest.raises(RuntimeError, match=r"trainer\.num_gpus = 1"):
        TorchTrainer(TrainerSection(num_gpus=1), tiny_dir)
    with pytest.raises(RuntimeError, match=r"engine\.num_gpus = 0.5"):
        load_causal_lm(str(tiny_dir), "float32", num_gpus=0.5)


@no_cuda
def test_engine_generates_on_the_gpu(tiny_dir: Path) -> None:
    be = TorchBackend(EngineSection(num_gpus=1), ModelSection(path=str(tiny_dir), dtype="bfloat16"))
    assert next(be.model.parameters()).device.type == "cuda"

    async def run() -> list[int]:
        gens = await asyncio.gather(*(be.generate([1, 2, 3 + i], SamplingParams(max_tokens=5))
                                      for i in range(3)))
        await be.close()
        return [len(g.token_ids) for g in gens]

    assert asyncio.run(run()) == [5, 5, 5]


@no_cuda
def test_trainer_steps_on_the_gpu(tiny_dir: Path, make_samples) -> None:  # type: ignore[no-untyped-def]
    t = TorchTrainer(TrainerSection(num_gpus=1, dtype="bfloat16", lr=1e-3), tiny_dir)
    assert next(t.model.parameters()).device.type == "cuda"
    m = t.train_step(Batch(samples=make_samples(4, seed=1)))
    assert m["skipped"] == 0.0 and m["step"] == 1.0
    assert all(v.device.type == "cpu" for v in t.state_dict_for_sync().values())


def test_cpu_pinning_covers_threads_started_before_and_after() -> None:
    """engine/trainer.cpu_affinity: every thread of the process (torch's pools started earlier
    included) ends up on the given cores. Run in a child process: pinning is process-wide."""
    import subprocess
    import sys

    code = (
        "import os, threading, time\n"
        "from rl360.policies.affinity import pin_to_cpus\n"
        "ev = threading.Event()\n"
        "t = threading.Thread(target=ev.wait, daemon=True); t.start()\n"
        "pin_to_cpus([0], 'engine.cpu_affinity')\n"
        "later = threading.Thread(target=ev.wait, daemon=True); later.start()\n"
        "print(sorted({tuple(sorted(os.sched_getaffinity(int(x)))) for x in os.listdir('/proc/self/task')}))\n"
        "ev.set()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[(0,)]"


def test_cpu_pinning_to_a_missing_core_names_the_key() -> None:
    from rl360.policies.affinity import pin_to_cpus

    pin_to_cpus([], "engine.cpu_affinity")  # no pinning asked: nothing happens
    with pytest.raises(ValueError, match=r"^trainer.cpu_affinity: no CPU core 4096 on this host"):
        pin_to_cpus([0, 4096], "trainer.cpu_affinity")


def test_niceness_covers_threads_started_before_and_after() -> None:
    """engine/trainer.nice: a process Ray started at niceness 15 takes the asked niceness on
    every thread (Linux keeps it per thread), those started later included."""
    import subprocess
    import sys

    if not hasattr(os, "setpriority"):
        pytest.skip("no os.setpriority on this platform")
    code = (
        "import os, threading\n"
        "from rl360.policies.affinity import set_niceness\n"
        "ev = threading.Event()\n"
        "t = threading.Thread(target=ev.wait, daemon=True); t.start()\n"
        "ok = set_niceness(0, 'engine.nice')\n"
        "later = threading.Thread(target=ev.wait, daemon=True); later.start()\n"
        "print(ok, sorted({os.getpriority(os.PRIO_PROCESS, int(x)) for x in os.listdir('/proc/self/task')}))\n"
        "ev.set()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=lambda: os.nice(15))  # as Ray starts its workers
    if out.stdout.startswith("False"):
        pytest.skip("lowering the niceness is not permitted here (no CAP_SYS_NICE)")
    assert out.stdout.strip() == "True [0]"


def test_niceness_refused_warns_with_the_key_and_keeps_going(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    from rl360.policies import affinity

    def refuse(*_: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(affinity.os, "setpriority", refuse)
    with caplog.at_level("WARNING", logger="rl360.affinity"):
        assert affinity.set_niceness(0, "trainer.nice") is False
    assert "trainer.nice = 0: not permitted here" in caplog.text
