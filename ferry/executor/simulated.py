"""The simulated executor: asks the cost model how long a step takes and moves the clock.

Same interface as the model executor, so the one engine loop and scheduler run
unchanged; no torch, no model. Every sampled token is 0: simulation runs use
ignore_eos and fixed lengths, so the values never matter. With speculative
decoding each draft is accepted with probability ``acceptance_rate`` (a verify
step costs its ``1 + k`` tokens whatever is accepted).
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING, Iterable, Protocol

from ferry.core.clock import ManualClock
from ferry.core.outputs import ModelRunnerOutput, SchedulerOutput
from ferry.executor.base import Executor

if TYPE_CHECKING:
    from ferry.model.config import ModelConfig


class StepCost(Protocol):
    """How long a step takes, from its composition (the simulator's ``CostModel``)."""

    model: ModelConfig

    def step_time(self, chunks: Iterable[tuple[int, int]], num_sampling: int) -> float:
        """Seconds for one step of these (num_tokens, start) chunks, ``num_sampling`` rows sampling."""
        ...


class SimulatedExecutor(Executor):
    """Moves ``clock`` by each step's modelled time and samples 0s."""

    def __init__(self, cost: StepCost, clock: ManualClock, acceptance_rate: float = 0.5, seed: int = 0) -> None:
        self.cost = cost
        self.clock = clock
        self.vocab_size = cost.model.vocab_size
        self.tokenizer = None
        self.eos_token_ids = ()
        self.acceptance_rate = acceptance_rate
        self.rng = random.Random(seed)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {}
        for c in out.chunks:
            if c.samples and not c.padding:
                sampled[c.request_id] = [0] * (1 + self._accepted(len(c.spec_token_ids)))
        self.clock.advance(self.cost.step_time(*out.cost_shape))
        return ModelRunnerOutput(sampled=sampled)

    def _accepted(self, k: int) -> int:
        """Drafts accepted: each in turn with probability ``acceptance_rate``, until one is not."""
        n = 0
        while n < k and self.rng.random() < self.acceptance_rate:
            n += 1
        return n
