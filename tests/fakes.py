"""A fake executor for testing the core and the engine loop without a model."""
from __future__ import annotations

from ferry.core.outputs import ModelRunnerOutput, SchedulerOutput
from ferry.executor.base import Executor
from ferry.executor.request_state import RequestStates


class FakeExecutor(Executor):
    """Checks each step's chunks against the request state, and 'samples' a deterministic token.

    The token depends only on the request's tokens so far, so any schedule gives the same text.
    It keeps its own per-request state from the plain scheduler outputs, as the model executor
    does, and a fake KV cache: each slot a chunk computes holds the identity of the prefix it
    was computed from, and every context slot a chunk reads must hold exactly the prefix the
    request has there (a block table pointing at the wrong, freed or overwritten block fails).
    Drafts are verified with the same rule: accepted while each is the rule's next token.

    ``repeat``: the rule continues the request's own text where it recurs (the next token is
    the one that followed the previous occurrence of the last token), so n-gram drafts get
    accepted; otherwise the tokens look random.
    """

    def __init__(self, vocab_size: int = 1000, block_size: int = 16, repeat: bool = False) -> None:
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.repeat = repeat
        self.steps: list[SchedulerOutput] = []
        self.states = RequestStates()
        self.kv: dict[int, int] = {}  # slot -> hash of the tokens up to and including its position

    def next_token(self, tokens: list[int]) -> int:
        if self.repeat and len(tokens) > 1:
            last = tokens[-1]
            for i in range(len(tokens) - 2, -1, -1):
                if tokens[i] == last:
                    return tokens[i + 1]
        return (sum(tokens) * 31 + len(tokens)) % self.vocab_size

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(out)
        self.states.apply(out)
        res = ModelRunnerOutput()
        for c in out.chunks:
            r = self.states[c.request_id]
            num_tokens = len(r.all_token_ids)
            spec = c.spec_token_ids
            end = c.start + c.num_tokens
            assert 0 <= c.start and end <= num_tokens + len(spec), (c.start, c.num_tokens, num_tokens)
            assert len(r.block_ids) * self.block_size >= end, "chunk runs past its blocks"
            tokens = r.all_token_ids + spec
            for p in range(c.start):
                assert self.kv.get(self._slot(r.block_ids, p)) == hash(tuple(tokens[:p + 1])), \
                    f"{c.request_id}: the KV of position {p} is not this request's"
            if not c.padding:
                for p in range(c.start, end):
                    self.kv[self._slot(r.block_ids, p)] = hash(tuple(tokens[:p + 1]))
            if c.samples and not c.padding:
                assert end == num_tokens + len(spec)
                seen = list(r.all_token_ids)
                new = [self.next_token(seen)]
                for d in spec:
                    if d != new[-1]:
                        break
                    seen.append(d)
                    new.append(self.next_token(seen))
                res.sampled[c.request_id] = new
        self.states.append_tokens(res.sampled)
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
        from ferry.core.clock import ManualClock

        self.clock = ManualClock()
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len

    def engine(self, config):
        from dataclasses import replace

        from ferry.engine.llm_engine import LLMEngine

        if config.max_model_len is None:
            config = replace(config, max_model_len=self.max_model_len)
        return LLMEngine(config, TimedFakeExecutor(self.clock), self.num_kv_blocks, clock=self.clock)
