"""What each step did, recorded by the engine for metrics and plots."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    start: float
    duration: float
    num_prefill_tokens: int  # tokens of chunks that are not single-token decodes
    num_decode_tokens: int
    num_padding_tokens: int  # static batching: slots spent on finished requests
    num_requests: int
    num_kv_blocks_used: int
    num_preempted: int
