"""The executor's own per-request state, kept between steps from plain scheduler outputs.

Pure Python (the simulator and tests' fake executors use it too). A request's token ids and
sampling settings arrive once (``NewRequest``); each step's chunks extend its block table;
the tokens the executor samples are appended here, so the scheduler never ships them back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ferry.core.outputs import SchedulerOutput
from ferry.core.sampling_params import SamplingParams


@dataclass(eq=False)
class CachedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # A mean-pooled embedding's running sum of hidden states, and the prompt positions it holds.
    pool_sum: Any = None
    pool_upto: int = 0
    images: tuple[Any, ...] = ()  # the prompt's ImageFeatures

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


class RequestStates:
    """Every live request the executor has been told of, by id."""

    def __init__(self) -> None:
        self.requests: dict[str, CachedRequest] = {}
        self._applied_step: int | None = None
        self._applied_chunks: set[str] = set()  # of that step

    def __getitem__(self, request_id: str) -> CachedRequest:
        return self.requests[request_id]

    def apply(self, out: SchedulerOutput) -> None:
        """Take in a step's bookkeeping: finished requests go, preempted ones lose their blocks,
        new ones arrive, chunks bring new blocks. Once per step and chunk: a retry of the same
        step with part of its chunks (the engine isolating a failing request) repeats nothing."""
        if out.step_id != self._applied_step:
            for rid in out.finished_req_ids:
                self.requests.pop(rid, None)
            for rid in out.preempted_req_ids:
                self.requests[rid].block_ids = []
            for new in out.new_requests:
                self.requests[new.request_id] = CachedRequest(
                    new.request_id, new.prompt_token_ids, new.sampling_params, new.eos_token_ids,
                    images=new.images)
            self._applied_step = out.step_id
            self._applied_chunks = set()
        for c in out.chunks:
            if c.request_id not in self._applied_chunks:
                self.requests[c.request_id].block_ids.extend(c.new_block_ids)
                self._applied_chunks.add(c.request_id)

    def append_tokens(self, sampled: dict[str, list[int]]) -> None:
        """Record a successful step's new tokens (the scheduler appends the same ones)."""
        for rid, tokens in sampled.items():
            r = self.requests[rid]
            r.all_token_ids.extend(tokens)
            r.output_token_ids.extend(tokens)
