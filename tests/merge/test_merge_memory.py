"""The streaming bound: merging holds about (N + 2) x the largest tensor, not the model.

Each checkpoint here is 12 x its largest tensor and a merge reads 3 of them (36 x), in 3-4
shards each: a loader that keeps a model, or even one input shard per checkpoint, alive fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
from merge_helpers import write_checkpoint

from rl360.merge import io
from rl360.merge import recipe as R
from rl360.merge.runner import merge_checkpoints

ROWS, COLS, LAYERS = 1024, 1024, 12  # largest tensor 4 MiB in fp32, 48 MiB per checkpoint
LARGEST = ROWS * COLS * 4
N = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("mem")
    gen = torch.Generator().manual_seed(0)
    base = {f"layers.{i}.w": torch.randn(ROWS, COLS, generator=gen) for i in range(LAYERS)}
    base["norm"] = torch.ones(COLS)
    paths = [write_checkpoint(root / "base", base, shards=4)]
    for e in range(N):
        tensors = {}
        for k, v in base.items():
            mask = torch.rand(v.shape, generator=gen) < 0.05
            tensors[k] = v + mask * 1e-3 * (e + 1)
        paths.append(write_checkpoint(root / f"e{e}", tensors, shards=3))
    return paths[0], paths[1:]


def test_loader_holds_at_most_n_plus_one_tensors(model, tmp_path, monkeypatch):
    """Every buffer the loader reads into is tracked, by storage, until it is freed."""
    live: dict[int, int] = {}
    peak = [0]
    read = io.Checkpoint.read

    def tracked(self: io.Checkpoint, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        t = read(self, name, out)
        storage = t.untyped_storage()
        if storage.data_ptr() not in live:
            live[storage.data_ptr()] = storage.nbytes()
            weakref.finalize(storage, live.pop, storage.data_ptr(), None)
        peak[0] = max(peak[0], sum(live.values()))
        return t

    monkeypatch.setattr(io.Checkpoint, "read", tracked)
    base, experts = model
    for i, cfg in enumerate([R.Ram(), R.Ties()]):
        peak[0] = 0
        out = R.Output(dir=str(tmp_path / f"out{i}"), max_shard_size="20MB")
        merge_checkpoints(
            base, [R.Expert(path=str(p)) for p in experts], cfg, out, R.Run(progress=False)
        )
        assert peak[0] <= (N + 1) * LARGEST, (cfg, peak[0] / LARGEST)
    assert not live


SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    sys.path.insert(0, sys.argv[1])
    from merge_helpers import write_checkpoint
    from rl360.merge import recipe as R
    from rl360.merge.runner import merge_checkpoints

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    here, base, out, *experts = sys.argv[1:]
    torch.set_num_threads(1)  # the machine may be shared; the bound does not depend on it
    run = R.Run(progress=False, chunk_elements=32768)
    # warm up every code path (imports, tqdm, thread pools) on a toy model first
    toy = {"a": torch.ones(3, 4), "b": torch.ones(4)}
    write_checkpoint(Path(out, "toy-base"), toy)
    write_checkpoint(Path(out, "toy-e"), {k: v * 2 for k, v in toy.items()})
    toy_e = [R.Expert(path=str(Path(out, "toy-e")))]
    growth = {}
    for name, cfg in (("ram", R.Ram()), ("ties", R.Ties())):
        merge_checkpoints(Path(out, "toy-base"), toy_e, cfg, R.Output(dir=f"{out}/toy-{name}"), run)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = status("VmRSS")
        output = R.Output(dir=f"{out}/{name}", max_shard_size="20MB")
        merge_checkpoints(base, [R.Expert(path=p) for p in experts], cfg, output, run)
        growth[name] = status("VmHWM") - before
    print(json.dumps(growth))
    """
)


def test_peak_rss_of_a_fresh_process_stays_near_n_plus_two_tensors(model, tmp_path):
    """Peak RSS growth of a merge in a fresh process. glibc's mmap threshold is pinned so
    freed tensors go back to the OS and RSS follows the memory the merge really holds."""
    base, experts = model
    here = Path(__file__).parent
    cmd = [sys.executable, "-c", SCRIPT, str(here), str(base), str(tmp_path), *map(str, experts)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    growth = json.loads(proc.stdout.strip().splitlines()[-1])
    read = (N + 1) * LAYERS * LARGEST
    bound = (N + 2) * LARGEST + 6 * 2**20  # + chunk temporaries, TIES histograms, interpreter
    for name, grew in growth.items():
        assert grew < bound, (
            f"{name}: grew {grew / LARGEST:.1f} x largest; reads {read / LARGEST:.0f} x"
        )
