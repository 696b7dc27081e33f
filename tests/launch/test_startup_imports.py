"""The actors that do not compute (env actors, the weight publisher, the session shards and
server, the rollout controller, the trajectory buffer) start without importing torch: on a
2-core box each torch import is ~2 s of CPU taken from the run's start-up."""

import subprocess
import sys

LIGHT = ["rl360.actors.env_pool", "rl360.weights.publisher", "rl360.serve.sessions.shard",
         "rl360.serve.sessions.http", "rl360.actors.controller", "rl360.actors.buffer"]


def test_light_actors_do_not_import_torch() -> None:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in LIGHT)
            + "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert out == "[]", f"an actor module pulled in {out}"
