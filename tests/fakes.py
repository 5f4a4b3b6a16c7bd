"""A fake executor for testing the core and the engine loop without a model."""
from __future__ import annotations

from ferry.core.outputs import ModelRunnerOutput, SchedulerOutput


class FakeExecutor:
    """Checks each step's chunks against the request state, and 'samples' a deterministic token.

    The token depends only on the request's tokens so far, so any schedule gives the same text.
    """

    def __init__(self, vocab_size: int = 1000, block_size: int = 16) -> None:
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.steps: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(out)
        res = ModelRunnerOutput()
        for c in out.chunks:
            r = c.request
            end = c.start + c.num_tokens
            assert 0 <= c.start and end <= r.num_tokens, (c.start, c.num_tokens, r.num_tokens)
            assert len(c.block_ids) * self.block_size >= end, "chunk runs past its blocks"
            if c.samples and not c.padding:
                assert end == r.num_tokens
                res.sampled[r.request_id] = (sum(r.all_token_ids) * 31 + r.num_tokens) % self.vocab_size
        return res


class TimedFakeExecutor(FakeExecutor):
    """A FakeExecutor on a ManualClock: each step takes ``base + per_token * tokens`` seconds."""

    def __init__(self, clock, base: float = 0.01, per_token: float = 0.001, **kw) -> None:
        super().__init__(**kw)
        self.clock = clock
        self.base = base
        self.per_token = per_token

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.clock.advance(self.base + self.per_token * out.total_num_scheduled_tokens)
        return super().execute(out)


class FakeEngineFactory:
    """Engines over TimedFakeExecutors sharing one ManualClock (bench code without a model)."""

    def __init__(self, num_kv_blocks: int = 400, max_model_len: int = 4096) -> None:
        from ferry.engine.clock import ManualClock

        self.clock = ManualClock()
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len

    def engine(self, config):
        from dataclasses import replace

        from ferry.engine.llm_engine import LLMEngine

        if config.max_model_len is None:
            config = replace(config, max_model_len=self.max_model_len)
        return LLMEngine(config, TimedFakeExecutor(self.clock), self.num_kv_blocks, clock=self.clock)
