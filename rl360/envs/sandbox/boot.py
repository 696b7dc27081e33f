"""Start a stdlib-only script inside a sandbox with its code compiled by the host.

A script passed as `python -c <source>` is compiled on every start (the exec server's ~800 lines:
~7 ms of CPU here, the isolated runner's ~600: ~20 ms under load, on top of the interpreter's
own ~9). Instead the sandbox runs BOOT (a few lines) and reads from stdin, in this order: the
bytecode magic number of the host's interpreter, the script compiled by the host (`marshal`),
its source and its file name, each as a 4-byte big-endian length and the bytes. BOOT runs the
compiled code when its interpreter's magic number is the same, else it compiles the source (a
sandbox with another Python still works, only slower). It reads with exact-size reads (no
read-ahead), so whatever follows on stdin (the runner's spec, the exec server's requests) is
still unread when the script starts. The script finds its source as the global BOOT_SOURCE.
BOOT makes its process non-dumpable (prctl PR_SET_DUMPABLE 0) before it reads a byte: a process
of the same uid can then neither trace it nor open its /proc/<pid>/fd, so the stdin memfd that
holds what follows (the runner's nonce and tests) is the process's alone from the start.
"""

from __future__ import annotations

import functools
import importlib.util
import marshal

# runs inside the sandbox with `python -I -S -c BOOT [args]` (stdlib only)
BOOT = """\
import marshal, os, sys
try:
    import _ctypes
    _ctypes.call_function(_ctypes.dlsym(_ctypes.dlopen(None), "prctl"), (4, 0, 0, 0, 0))
except Exception:
    pass
def _rd(n):
    b = b""
    while len(b) < n:
        c = os.read(0, n - len(b))
        if not c:
            raise SystemExit("rl360 boot: the script's input was cut short")
        b += c
    return b
def _part():
    return _rd(int.from_bytes(_rd(4), "big"))
_m, _c, _s, _f = _part(), _part(), _part().decode(), _part().decode()
_x = sys.modules.get("_frozen_importlib_external")
_g = {"__name__": "__main__", "BOOT_SOURCE": _s}
exec(marshal.loads(_c) if getattr(_x, "MAGIC_NUMBER", None) == _m else compile(_s, _f, "exec"), _g)
"""


@functools.cache
def boot_head(source: str, filename: str) -> bytes:
    """What BOOT reads first: the script compiled (once per process), its source and name."""
    code = marshal.dumps(compile(source, filename, "exec"))
    return b"".join(len(p).to_bytes(4, "big") + p for p in
                    (importlib.util.MAGIC_NUMBER, code, source.encode(), filename.encode()))
