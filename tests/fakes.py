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
