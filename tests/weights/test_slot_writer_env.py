"""The process that writes weight slots (trainer rank 0) is started with glibc's streaming-store
threshold lowered (rl360.weights.slots.writer_env): the setting is one glibc accepts, a
caller's other tunables are kept, and only rank 0 of a run that writes slots gets it."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest

from rl360.launch.train_run import trainer_rank_options
from rl360.recipe import apply_overrides, decode_recipe
from rl360.weights.slots import STREAM_FROM_BYTES, writer_env

LOADER = Path("/lib64/ld-linux-x86-64.so.2")
x86 = pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86-64 glibc tunable")


@x86
@pytest.mark.skipif(not LOADER.exists(), reason="no x86-64 dynamic loader to ask")
def test_glibc_takes_the_threshold() -> None:
    listed = subprocess.run([str(LOADER), "--list-tunables"], capture_output=True, text=True,
                            env={**os.environ, **writer_env({})}, timeout=30)
    if listed.returncode != 0:
        pytest.skip("this glibc's loader cannot list its tunables")
    line = next(x for x in listed.stdout.splitlines() if "x86_non_temporal_threshold" in x)
    assert line.split(":")[1].split()[0] == hex(STREAM_FROM_BYTES)  # a typo would be ignored


@x86
def test_a_callers_tunables_are_kept_and_its_own_threshold_wins() -> None:
    assert writer_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == (
        f"glibc.malloc.arena_max=2:glibc.cpu.x86_non_temporal_threshold={STREAM_FROM_BYTES:#x}")
    assert writer_env({"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x4040"}) == {}


class _Placement:
    def trainer_options(self, rank: int) -> dict[str, object]:
        return {"num_cpus": 1, "runtime_env": {"env_vars": {"KEEP": str(rank)}}}


@x86
def test_only_rank_0_of_a_run_writing_slots_gets_it() -> None:
    options = trainer_rank_options(decode_recipe(apply_overrides({}, [])), _Placement())  # type: ignore[arg-type]
    zero, one = options(0), options(1)
    assert zero["runtime_env"]["env_vars"] == {"KEEP": "0", **writer_env()}  # type: ignore[index]
    assert one == _Placement().trainer_options(1)
    for off in ("train.weight_sync={transport='object_store', slots=0}",
                "train.weight_sync={transport='object_store', zero_copy=false}",
                "train.weight_sync={transport='collective'}"):
        options = trainer_rank_options(decode_recipe(apply_overrides({}, [off])), _Placement())  # type: ignore[arg-type]
        assert options(0) == _Placement().trainer_options(0), off
