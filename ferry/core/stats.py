"""What the scheduler reports to whoever watches it: what a step did, and its load at a moment.

Observers (the engine's step records, Prometheus metrics, the dashboard) read these values and
never the scheduler's own counters or its block pool, so they need no idea of how it counts.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    """What the scheduler did in one step (``Scheduler.take_stats``): counts for that step alone.

    A step that scheduled nothing has no update and no report of its own: what it did (a
    preemption, in principle) is counted in the next step's report, so no event is lost.
    """

    num_preempted: int = 0  # requests preempted (recompute)
    num_prefix_queried_tokens: int = 0  # prompt tokens of admitted requests looked up in the prefix cache
    num_prefix_hit_tokens: int = 0  # of those, found there (not computed)
    num_drafts: int = 0  # speculative verify chunks
    num_draft_tokens: int = 0  # draft tokens they proposed
    num_accepted_tokens: int = 0  # of those, accepted
    # Images whose prompt span began in this step with their encoder output already held (another
    # request's, or its own before a preemption): not encoded again.
    num_encoder_cache_hits: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerState:
    """The scheduler's load at one moment (``Scheduler.state``): what gauges and the dashboard show."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks: int  # the whole cache
    num_preemptions: int  # since the scheduler started

    @property
    def num_kv_blocks_free(self) -> int:
        return self.num_kv_blocks - self.num_kv_blocks_used

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV blocks in use (0-1)."""
        return self.num_kv_blocks_used / self.num_kv_blocks if self.num_kv_blocks else 0.0
