"""When each part of a run's start-up was up: seconds from one origin, marked from any thread.

    clock = StartupClock()               # origin: now (or pass the run's own start time)
    clock.mark("ray")                    # after ray.init
    clock.line()                         # "ray 6.1 s, placement 6.2 s, ..." for the log
    clock.as_metrics()                   # {"startup/ray_s": 6.1, ...} for the first step's row

Marks are the wall time from the origin to the moment a part was ready (not each part's own
duration: start-up overlaps, so durations do not add up to the total).
"""

from __future__ import annotations

import threading
import time


class StartupClock:
    def __init__(self, origin: float | None = None) -> None:
        self.origin = time.monotonic() if origin is None else origin
        self._at: dict[str, float] = {}
        self._lock = threading.Lock()

    def mark(self, name: str) -> float:
        """Records `name` as up now; returns its seconds from the origin."""
        s = time.monotonic() - self.origin
        with self._lock:
            self._at[name] = s
        return s

    @property
    def marks(self) -> dict[str, float]:
        """name -> seconds from the origin, in the order they were marked."""
        with self._lock:
            return dict(sorted(self._at.items(), key=lambda kv: kv[1]))

    def line(self) -> str:
        return ", ".join(f"{k} {v:.1f} s" for k, v in self.marks.items())

    def as_metrics(self) -> dict[str, float]:
        return {f"startup/{k}_s": round(v, 3) for k, v in self.marks.items()}
