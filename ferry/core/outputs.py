"""What flows between scheduler and executor each step."""
from __future__ import annotations

from dataclasses import dataclass, field

from ferry.core.request import Request


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` starting at position ``start``.

    ``samples`` is true when the chunk reaches the end of the request's known
    tokens, so the step yields its next token. A padding chunk (static batching)
    recomputes a finished request's last token: real work, discarded result.
    """

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]
    samples: bool
    padding: bool = False


@dataclass
class SchedulerOutput:
    """One step's boarding list: ``{request_id: num_tokens}`` plus what the runner needs."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Finished since the previous step (by stop, length or abort): the runner drops their state.
    finished_req_ids: list[str] = field(default_factory=list)
    num_kv_blocks_used: int = 0

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {c.request.request_id: c.num_tokens for c in self.chunks}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_padding_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if c.padding)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class ModelRunnerOutput:
    """Sampled token per request that sampled this step (and its top logprobs if asked)."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # Requests whose computation failed this step: request_id -> error message.
    errors: dict[str, str] = field(default_factory=dict)
    # Prompt logprobs computed this step: request_id -> (index of the first prompt token they
    # score, one entry per consecutive prompt token).
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)

    def update(self, other: "ModelRunnerOutput") -> None:
        """Take in the results of another part of the same step."""
        self.sampled.update(other.sampled)
        self.logprobs.update(other.logprobs)
        self.errors.update(other.errors)
        self.prompt_logprobs.update(other.prompt_logprobs)
