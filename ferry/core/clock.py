"""The engine's clock. Every timestamp in ferry comes from one of these, so a
simulated clock can stand in for the wall clock without touching the engine.

Here, below the engine and the executors, because both read it (the simulated executor moves a
``ManualClock`` by each step's modelled time)."""
from __future__ import annotations

import time


class WallClock:
    """Seconds from ``time.perf_counter``."""

    def __call__(self) -> float:
        return time.perf_counter()

    def sleep_until(self, t: float) -> None:
        """Wait (really) until the clock reads ``t``."""
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class ManualClock:
    """A clock that only moves when told to (tests, simulation)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep_until(self, t: float) -> None:
        """Jump to ``t`` (an idle engine waiting for the next arrival costs no real time)."""
        self.now = max(self.now, t)
