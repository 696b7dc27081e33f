"""Engine backends behind one contract (see base.EngineBackend) and their factory."""

from rl360.serve.engines.base import (
    BACKENDS,
    EngineBackend,
    build_engine_backend,
)

__all__ = ["BACKENDS", "EngineBackend", "build_engine_backend"]
