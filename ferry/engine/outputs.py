"""What the engine hands back to callers: one RequestOutput per request per step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Per-request timings (engine clock, seconds) and derived latencies."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: list[float]  # when each output token was produced
    num_preemptions: int
    num_recomputed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not computed

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (last token - first token) / (tokens - 1).

        For a request that finished at its last token this is (e2e - ttft) / (tokens - 1).
        None with fewer than 2 tokens (no gap to average), as serving benchmarks do.
        """
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itls(self) -> list[float]:
        """Every inter-token latency: the gaps between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    # Per prompt token once prefilled (None for the first), when asked for with prompt_logprobs.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Tokens this output adds to the previous one (with speculation a step may add several).
    num_new_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's normalised vector (SamplingParams.pooling)
