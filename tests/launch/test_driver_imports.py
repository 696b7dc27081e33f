"""The `rl360 train` driver imports no torch: the trainer ranks and engine replicas need it, the
driver only builds calls for them, and importing torch is most of the driver's start before
`ray.init` (`import rl360.launch.train_run`: 4.7 s with torch, 2.3 s without, 2 cores)."""

from __future__ import annotations

import subprocess
import sys


def test_the_train_driver_and_the_transports_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import rl360.launch.train_run, rl360.weights.transports, rl360.weights.sender_calls\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
