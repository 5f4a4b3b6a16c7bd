"""What each step did, recorded by the engine for metrics, plots and observers (Prometheus, the
dashboard): they read these, never the scheduler's counters."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    start: float
    duration: float
    num_prefill_tokens: int  # tokens of chunks that are not decodes (recompute included)
    num_decode_tokens: int  # tokens of decode chunks (``ScheduledChunk.decode``), padding aside
    num_padding_tokens: int  # static batching: idle slot-steps, spent recomputing finished requests
    num_requests: int
    num_kv_blocks_used: int
    num_preempted: int  # requests preempted in this step
    # Speculative decoding: verify chunks, their draft tokens, and how many were accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Prefix caching: prompt tokens of the requests admitted in this step looked up, and found.
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    # Images: the vision encoder's seconds per image it ran in this step, and the images whose
    # encoder output was already held (not encoded again).
    encoder_seconds: tuple[float, ...] = ()
    num_encoder_cache_hits: int = 0
    # The step's composition as the cost model reads it ((num_tokens, start) per chunk, LM-head
    # rows) and its whole wall time, scheduling and outputs included: what calibration fits.
    shape: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    num_sampling_rows: int = 0
    wall: float = 0.0
    # Who was in the step and how: the request timeline is drawn from these.
    prefill_ids: tuple[str, ...] = field(default=(), repr=False)
    decode_ids: tuple[str, ...] = field(default=(), repr=False)
    padding_ids: tuple[str, ...] = field(default=(), repr=False)
    preempted_ids: tuple[str, ...] = field(default=(), repr=False)

    @property
    def num_tokens(self) -> int:
        """Token slots computed in this step, padding included."""
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_padding_tokens
