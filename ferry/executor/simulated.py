"""The simulated executor: asks the cost model how long a step takes and moves the clock.

Same interface as the model executor, so the one engine loop and scheduler run
unchanged; no torch, no model. Every sampled token is 0: simulation runs use
ignore_eos and fixed lengths, so the values never matter.
"""
from __future__ import annotations

from ferry.core.outputs import ModelRunnerOutput, SchedulerOutput
from ferry.engine.clock import ManualClock
from ferry.sim.cost_model import CostModel


class SimulatedExecutor:
    def __init__(self, cost: CostModel, clock: ManualClock) -> None:
        self.cost = cost
        self.clock = clock
        self.vocab_size = cost.model.vocab_size
        self.tokenizer = None
        self.eos_token_ids = ()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {c.request.request_id: 0 for c in out.chunks if c.samples and not c.padding}
        self.clock.advance(self.cost.step_time(((c.num_tokens, c.start) for c in out.chunks), len(sampled)))
        return ModelRunnerOutput(sampled=sampled)
