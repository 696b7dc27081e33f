"""Free TCP ports for tests that start servers (Ray heads, Serve, dashboards)."""

from __future__ import annotations

import contextlib
import random
import socket


def free_ports(n: int = 1) -> list[int]:
    """n distinct free ports on 127.0.0.1, from 20000-32000: below the kernel's ephemeral
    range (32768+, where a raylet's own sockets took a port picked with bind(0) before Serve
    bound it) and above Ray's worker ports (10002-19999). Every socket stays bound until all n
    are picked: picking them one at a time could hand out the same port twice."""
    rng = random.Random()
    with contextlib.ExitStack() as stack:
        picked: list[socket.socket] = []
        for _ in range(200 * n):
            if len(picked) == n:
                break
            s = stack.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", rng.randrange(20000, 32000)))
            except OSError:
                continue
            picked.append(s)
        if len(picked) < n:
            raise RuntimeError(f"found only {len(picked)} of {n} free ports in 20000-32000")
        return [s.getsockname()[1] for s in picked]
