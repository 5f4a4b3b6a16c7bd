"""One request can never hurt another: a failing step fails only the request that causes it."""
from __future__ import annotations

import pytest

from ferry import SamplingParams
from ferry.engine.llm_engine import LLMEngine
from ferry.executor.base import Executor


class PoisonExecutor(Executor):
    """Wraps the model executor; any step holding the poisoned request raises, as a bad value
    that passed validation would."""

    def __init__(self, inner, poison: str) -> None:
        self.inner = inner
        self.poison = poison
        self.calls = 0
        for name in ("vocab_size", "tokenizer", "eos_token_ids", "num_kv_blocks", "max_model_len"):
            setattr(self, name, getattr(inner, name))

    def execute(self, out):
        self.calls += 1
        if any(c.request_id == self.poison for c in out.chunks):
            raise OverflowError("injected fault")
        return self.inner.execute(out)


def _run(engine: LLMEngine, prompts, params) -> dict:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, request_id=f"r{i}")
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0]
    return final


def test_a_poisoned_request_fails_alone_and_the_others_finish_as_in_a_clean_run(llm, parity_prompts):
    prompts = [p[:40] for p in parity_prompts] + [parity_prompts[0] + [7, 8], parity_prompts[1][:9]]
    assert len(prompts) == 10
    # Greedy, seeded and penalised: every kind of row a step samples.
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) if i % 3 == 0 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12, ignore_eos=True) if i % 3 == 1
              else SamplingParams(temperature=0.7, seed=i, repetition_penalty=1.2, max_tokens=12, ignore_eos=True)
              for i in range(10)]
    clean = _run(LLMEngine.from_config(llm.config, llm.engine.executor), prompts, params)

    poisoned = PoisonExecutor(llm.engine.executor, poison="r4")
    engine = LLMEngine.from_config(llm.config, poisoned)
    got = _run(engine, prompts, params)

    assert got["r4"].finish_reason == "error" and "OverflowError: injected fault" in got["r4"].stop_reason
    assert got["r4"].token_ids == []
    for rid, comp in clean.items():
        if rid != "r4":
            assert got[rid].finish_reason == "length" and got[rid].token_ids == comp.token_ids, rid
    assert engine.num_failed_requests == 1
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    # Isolation by halving: the first full step, then about log2(10) retries, then clean steps.
    assert poisoned.calls < len(engine.step_stats) + 10


def test_a_step_that_fails_only_in_a_large_group_fails_no_one(llm, parity_prompts):
    """A fault of the batch, not of a request (say, memory for a large step): every request
    succeeds when retried in smaller groups."""

    class FailsWhenBig(Executor):
        def __init__(self, inner):
            self.inner = inner
            for name in ("vocab_size", "tokenizer", "eos_token_ids", "num_kv_blocks", "max_model_len"):
                setattr(self, name, getattr(inner, name))

        def execute(self, out):
            if len(out.chunks) > 2:
                raise MemoryError("injected: step too large")
            return self.inner.execute(out)

    prompts = [p[:20] for p in parity_prompts[:5]]
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 5
    clean = _run(LLMEngine.from_config(llm.config, llm.engine.executor), prompts, params)
    engine = LLMEngine.from_config(llm.config, FailsWhenBig(llm.engine.executor))
    got = _run(engine, prompts, params)
    assert {rid: c.token_ids for rid, c in got.items()} == {rid: c.token_ids for rid, c in clean.items()}
    assert engine.num_failed_requests == 0


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1, True, 1.5])
def test_a_seed_that_no_64_bit_generator_takes_is_refused_up_front(seed):
    with pytest.raises(ValueError, match="seed must be an integer in"):
        SamplingParams(seed=seed)


def test_extreme_seeds_sample_and_n_wraps_them(llm):
    sp = SamplingParams(temperature=1.0, seed=2**63 - 1, max_tokens=3, n=3, ignore_eos=True)
    out = llm.generate("Hello", sp, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3, 3]
    assert sp.nth(1).seed == -(2**63)  # wraps around within the signed 64-bit range
    again = llm.generate("Hello", sp, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
