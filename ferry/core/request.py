"""One request's token-level state, as the scheduler sees it.

Progress is a single counter, ``num_computed_tokens``, that chases ``num_tokens``
(prompt plus the tokens generated so far). A prefill chunk, a decode, a
recompute after preemption, a prefix-cache hit and a speculative verify are all
"advance this counter by N". Text, stop strings and logprobs are the engine's
output processor's (``ferry.engine.output_processor``): the core never sees them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ferry.core.multimodal import ImageFeature
from ferry.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is; the finished ones carry the OpenAI-style finish_reason."""

    WAITING = ("waiting", None)
    RUNNING = ("running", None)
    PREEMPTED = ("preempted", None)
    FINISHED_STOPPED = ("finished_stopped", "stop")
    FINISHED_LENGTH = ("finished_length", "length")
    FINISHED_ABORTED = ("finished_aborted", "abort")
    FINISHED_ERROR = ("finished_error", "error")

    def __init__(self, _label: str, finish_reason: str | None) -> None:
        # Plain attributes, not properties: the scheduler reads them for every request every step.
        # (The label only keeps the members' values distinct.)
        self.finish_reason = finish_reason
        self.finished = finish_reason is not None


@dataclass
class RequestTimes:
    """Timestamps from the engine's clock (seconds)."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()  # any of them ends the request (unless ignore_eos)
    priority: int = 0
    max_tokens: int = 16  # resolved from sampling_params by the scheduler
    # The prompt's images, in order of offset (placeholder spans inside prompt_token_ids).
    images: tuple[ImageFeature, ...] = ()

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    boarded_step: int = 0  # the scheduler step in which it last went from waiting to running
    num_recomputed_tokens: int = 0  # tokens whose KV was computed, dropped by preemption, computed again
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    # A stop token id, a stop string (the output processor finds it, the engine finishes the
    # request) or an error message.
    stop_reason: int | str | None = None
    embedding: list[float] | None = None  # an embedding request's vector, once its prompt is in
    times: RequestTimes = field(init=False)
    # Set once by the scheduler: monotonically increasing arrival sequence, breaks ties.
    seq: int = 0
    # Prefix caching: the hash chain of the full blocks of known tokens (filled lazily by the
    # KV cache manager), and how many of the request's blocks it has registered in the cache.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_blocks_sent: int = 0  # how much of its block table the executor has been told
    # Speculative decoding: the draft tokens of the step in flight.
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.times = RequestTimes(arrival=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
