"""A nested phase timer for the per-step time breakdown.

    timer = Timer()
    with timer.time("logprobs"):
        with timer.time("reference"):
            ...
    timer.metrics()  # {"timing/logprobs": 1.2, "timing/logprobs/reference": 0.7}
    timer.reset()    # at the start of each step

A phase entered several times in one step accumulates. Nested phases are included in
their parent's time, so the top-level keys (no "/" after the prefix) add up to the step's
timed wall time; the plots stack only those.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class Timer:
    def __init__(self) -> None:
        self._stack: list[str] = []
        self._totals: dict[str, float] = {}

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time the block as phase `name`, nested under the phases currently open."""
        if not name or "/" in name:
            raise ValueError(f"a timer phase name must be non-empty and without '/', got {name!r}")
        key = "/".join([*self._stack, name])
        self._stack.append(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[key] = self._totals.get(key, 0.0) + time.perf_counter() - start
            self._stack.pop()

    def metrics(self, prefix: str = "timing/") -> dict[str, float]:
        """Seconds per phase since the last `reset()`, keyed `<prefix><phase>[/<sub-phase>...]`."""
        return {f"{prefix}{k}": v for k, v in self._totals.items()}

    def reset(self) -> None:
        if self._stack:
            raise RuntimeError(f"Timer.reset() inside open phases {'/'.join(self._stack)}")
        self._totals.clear()
