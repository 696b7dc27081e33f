"""`--ray` merges output shards as Ray tasks and writes exactly the bytes of the serial path."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rl360.merge import MergeError
from rl360.merge import recipe as R
from rl360.merge.runner import SUMMARY_FILE, merge_checkpoints

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # the session cluster of tests/conftest.py is already up
        yield
        return
    # address="local": always a fresh cluster, never one another process left on this machine
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    from merge_helpers import write_checkpoint

    root = tmp_path_factory.mktemp("ray-model")
    gen = torch.Generator().manual_seed(5)
    base = {f"layers.{i}.w": torch.randn(48, 40, generator=gen).bfloat16() for i in range(6)}
    base["norm"] = torch.ones(40).bfloat16()
    base["position_ids"] = torch.arange(16)
    experts = []
    for e in range(3):
        t = {}
        for k, v in base.items():
            if v.is_floating_point():
                keep = torch.rand(v.shape, generator=gen) < 0.2
                t[k] = (v.float() + keep * 0.02 * torch.randn(v.shape, generator=gen)).bfloat16()
            else:
                t[k] = v
        experts.append(write_checkpoint(root / f"e{e}", t, shards=2))
    return write_checkpoint(root / "base", base, shards=3), experts


METHODS = [
    R.Ties(),
    R.DareLinear(rescale="l1", seed=1),
    R.RamPlus(),
    R.UlpGate(policy="snap"),
    R.GramSoup(),
    R.IsoCts(),
]


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != SUMMARY_FILE}


def test_ray_output_is_byte_identical_to_serial(local_ray, model, tmp_path, monkeypatch):
    from rl360.merge import runner

    tasks = []
    ray_map = runner._ray_map

    def counting(fn, job, method, args, *rest):
        tasks.extend(args)
        return ray_map(fn, job, method, args, *rest)

    monkeypatch.setattr(runner, "_ray_map", counting)
    base, paths = model
    experts = [R.Expert(path=str(p), weight=w) for p, w in zip(paths, [1.0, 0.7, 1.2], strict=True)]
    run = R.Run(progress=False, chunk_elements=1024)
    for cfg in METHODS:
        name = type(cfg).__name__
        outs = {}
        for mode in ("serial", "ray"):
            out = R.Output(dir=str(tmp_path / name / mode), max_shard_size="4KB")
            s = merge_checkpoints(base, experts, cfg, out, run, ray=mode == "ray")
            outs[mode] = files(Path(out.dir))
            assert s.shards >= 5 and s.stats.copied == 1
        assert outs["serial"].keys() == outs["ray"].keys()
        for f in outs["serial"]:
            assert outs["serial"][f] == outs["ray"][f], (name, f)
    assert len(tasks) >= 6 * 5 + 3 * 5 + 5  # merge tasks, TIES' 3 and RAM+'s 1 stats passes


def test_bad_input_inside_a_ray_task_is_one_merge_error(local_ray, model, tmp_path):
    from merge_helpers import write_checkpoint

    base, _ = model
    bad = write_checkpoint(tmp_path / "bad", {
        **{f"layers.{i}.w": torch.zeros(48, 40).bfloat16() for i in range(6)},
        "norm": torch.ones(40).bfloat16(),
        "position_ids": torch.arange(16) + 1,
    })  # fmt: skip
    out = R.Output(dir=str(tmp_path / "out"), max_shard_size="4KB")
    with pytest.raises(MergeError, match="tensor position_ids: non-float tensor differs") as info:
        merge_checkpoints(
            base, [R.Expert(path=str(bad))], R.Soup(), out, R.Run(progress=False), ray=True
        )
    assert "\n" not in str(info.value)
