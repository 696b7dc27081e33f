"""The `rl360 train` driver imports no torch: the trainer ranks and engine replicas need it, the
driver only builds calls for them, and importing torch is most of the driver's start before
`ray.init` (`import rl360.launch.train_run`: 4.7 s with torch, 2.3 s without, 2 cores)."""

from __future__ import annotations

from tests.fresh import last_line


def test_the_train_driver_and_the_transports_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import rl360.launch.train_run, rl360.weights.transports, rl360.weights.sender_calls\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    assert last_line(code) == "[]"
