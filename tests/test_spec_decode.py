"""Speculative decoding by n-gram prompt lookup: the proposer, the scheduler's 1 + k chunks
inside the budget (fake executor, properties), the verifier's output distribution, and the
real model's outputs with speculation on and off."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferry.config import EngineConfig, SpeculativeConfig
from ferry.core.ngram import propose_ngram
from ferry.core.outputs import ScheduledChunk
from ferry.core.sampling_params import SamplingParams
from ferry.core.clock import ManualClock
from ferry.engine.llm_engine import LLMEngine
from ferry.executor.request_state import CachedRequest
from ferry.executor.sampler import Sampler, verify
from tests.fakes import FakeExecutor
from tests.test_prefix_caching import check_blocks


@pytest.fixture(scope="module")
def llm(exact_llm):
    """Exact products, so speculation must give the very same tokens."""
    return exact_llm


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def make_engine(spec: dict | None, num_blocks: int = 64, **kw) -> tuple[LLMEngine, FakeExecutor]:
    cfg = EngineConfig(max_model_len=4096, block_size=4, speculative_config=spec, **kw)
    ex = FakeExecutor(block_size=4, vocab_size=20, repeat=True)
    return LLMEngine(cfg, ex, num_kv_blocks=num_blocks, clock=ManualClock()), ex


# ------------------------------------------------------------------ the proposer
def test_ngram_proposes_what_followed_the_latest_longest_match():
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" recurs; the latest earlier occurrence (index 6) was followed by 7 8 5.
    assert propose_ngram(toks, 3, 1, 2) == [7, 8, 5]
    assert propose_ngram(toks, 1, 1, 2) == [7]
    # With n up to 3, "5 2 3" does not recur; "2 3" still does.
    assert propose_ngram(toks, 2, 2, 3) == [7, 8]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # nothing recurs
    assert propose_ngram([5, 1, 2, 5], 3, 2, 3) == []  # only a 1-gram recurs, min is 2
    assert propose_ngram([5, 1, 2, 5], 3, 1, 3) == [1, 2, 5]


def test_speculative_config_is_parsed_and_checked_like_vllm():
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert cfg.speculative_config == SpeculativeConfig("ngram", 5, 1, 4)
    for bad, word in [('{"method": "eagle"}', "method"), ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                      ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
                      ('{"k": 3}', "unknown"), ("{nope", "JSON")]:
        with pytest.raises(ValueError, match=word):
            EngineConfig(speculative_config=bad)


# ------------------------------------------------------------------ the scheduler
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), budget=st.integers(2, 40), num_blocks=st.integers(24, 80),
       k=st.integers(1, 5))
def test_speculation_changes_no_output_and_stays_in_the_budget(seed, budget, num_blocks, k):
    rng = random.Random(seed)
    work = [([rng.randrange(1, 20) for _ in range(rng.randint(1, 30))], rng.randint(1, 40)) for _ in range(12)]
    spec = dict(NGRAM, num_speculative_tokens=k)
    outs = {}
    for cfg in (None, spec):
        engine, ex = make_engine(cfg, num_blocks, max_num_batched_tokens=budget, max_num_seqs=6)
        for i, (prompt, n) in enumerate(work):
            engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), request_id=f"r{i}")
        final = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    final[o.request_id] = o
            check_blocks(engine)
            s = ex.steps[-1]
            assert s.total_num_scheduled_tokens <= budget
            assert all(len(c.spec_token_ids) <= k and c.num_tokens >= 1 + len(c.spec_token_ids) for c in s.chunks)
        assert all(o.outputs[0].finish_reason == "length" for o in final.values())
        assert all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip((final[f"r{i}"] for i in range(12)), work))
        outs[cfg is None] = {rid: o.outputs[0].token_ids for rid, o in final.items()}
        assert engine.kv.pool.num_used == 0
        if cfg is not None:
            sched = engine.scheduler
            # Every draft token was scheduled and either accepted or not; the step stats agree.
            assert sched.num_draft_tokens == sum(len(c.spec_token_ids) for s in ex.steps for c in s.chunks)
            assert sched.num_accepted_tokens <= sched.num_draft_tokens
            assert sum(st_.num_accepted_tokens for st_ in engine.step_stats) == sched.num_accepted_tokens
    assert outs[True] == outs[False]


def test_drafts_are_accepted_on_repetitive_text_and_save_steps():
    steps = {}
    for cfg in (None, NGRAM):
        engine, ex = make_engine(cfg)
        engine.add_request([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], SamplingParams(max_tokens=30, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        steps[cfg is None] = len(ex.steps)
        if cfg is not None:
            assert engine.scheduler.num_accepted_tokens >= 20
    assert steps[False] <= steps[True] // 3


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    engine, ex = make_engine(NGRAM)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    # The repeating rule continues 2 3 4 5 ...: 4 is the stop token, reached inside a verify.
    engine.add_request(prompt, SamplingParams(max_tokens=30, stop_token_ids=[4]), request_id="a")
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            final = o
    assert final.outputs[0].token_ids == [2, 3, 4] and final.outputs[0].stop_reason == 4
    assert any(c.spec_token_ids for s in ex.steps for c in s.chunks)


def test_no_drafts_for_penalties_or_when_the_budget_is_one_token():
    engine, ex = make_engine(NGRAM, max_num_batched_tokens=1)
    engine.add_request([1, 2, 1, 2, 1], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request([1, 2, 1, 2, 1], SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.2))
    while engine.has_unfinished():
        engine.step()
    assert not any(c.spec_token_ids for s in ex.steps for c in s.chunks)


def test_no_drafts_while_the_batch_is_at_disable_by_batch_size():
    engine, ex = make_engine(dict(NGRAM, disable_by_batch_size=2))
    for i in range(2):
        engine.add_request([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=12 + 8 * i, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    drafted = [len(s.chunks) for s in ex.steps if any(c.spec_token_ids for c in s.chunks)]
    assert drafted and all(n == 1 for n in drafted)  # only once the first request has left


def test_simulator_verify_steps_cost_their_drafts():
    from ferry.sim.engine import SimEngineFactory
    from ferry.sim.hardware import load_hardware
    from ferry.sim.models import load_model_config

    f = SimEngineFactory(load_model_config("smollm2-135m"), load_hardware("h100-sxm"), spec_acceptance_rate=1.0)
    eng = f.engine(EngineConfig(speculative_config=NGRAM))
    eng.add_request([0] * 20, SamplingParams(max_tokens=41, ignore_eos=True))  # the simulator samples 0s
    while eng.has_unfinished():
        eng.step()
    # Always accepted: 1 prefill step, then 10 verify steps of 1 + 3 tokens (4 new tokens each).
    assert [s.num_decode_tokens for s in eng.step_stats] == [0] + [4] * 10
    assert eng.scheduler.num_accepted_tokens == 30
    # A verify chunk runs as decode rows (as the executor packs it): never a prefill chunk to the
    # cost model (no per-prefill-chunk cost, no context gather), each row reading its own context.
    assert eng.step_stats[1].shape == ((1, 20), (1, 21), (1, 22), (1, 23))
    assert f.cost.terms(eng.step_stats[1].shape, 4).num_prefill_chunks == 0


# ------------------------------------------------------------------ the verifier
def test_verify_keeps_drafts_while_the_target_agrees():
    assert verify([7, 8, 9], [7, 8, 9, 4]) == [7, 8, 9, 4]
    assert verify([7, 8, 9], [7, 5, 9, 4]) == [7, 5]
    assert verify([7], [3, 1]) == [3]
    assert verify([], [6]) == [6]


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_rejection_sampling_gives_the_targets_distribution():
    """Two verify rows on a 6-token vocabulary, draft token 2 (likely but not certain under the
    target): the first token, and the second given the first draft was accepted, are distributed
    as the target says (chi-square, p = 1e-4 critical value for 5 degrees of freedom)."""
    v = 6
    p0 = torch.tensor([0.05, 0.15, 0.4, 0.1, 0.2, 0.1])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.25, 0.05, 0.2])
    logits = torch.stack([p0.log(), p1.log()])
    sampler = Sampler(seed=1)
    req = CachedRequest("r", [0], SamplingParams(temperature=1.0))
    chunk = ScheduledChunk("r", start=0, num_tokens=2, new_block_ids=[], samples=True, spec_token_ids=[2])
    first, second = [0] * v, [0] * v
    n = 20000
    for _ in range(n):
        toks = sampler.sample(logits, [(req, chunk)])[0]["r"]
        first[toks[0]] += 1
        if toks[0] == 2:
            assert len(toks) == 2
            second[toks[1]] += 1
        else:
            assert len(toks) == 1  # a rejected draft ends the step
    critical = 25.74
    assert _chi_square(first, p0.tolist()) < critical
    assert _chi_square(second, p1.tolist()) < critical
    # The test can tell: always accepting the draft would put everything on token 2.
    assert _chi_square([0, 0, n, 0, 0, 0], p0.tolist()) > critical


# ------------------------------------------------------------------ the real model
def test_greedy_and_seeded_outputs_are_the_same_with_speculation(llm, parity_prompts):
    from ferry import LLM

    spec = LLM(quant_activations="exact", speculative_config=dict(NGRAM, num_speculative_tokens=4))
    rng = random.Random(0)
    randoms = [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 60))] for _ in range(4)]
    repetitive = llm.tokenizer.encode("one two three four five, one two three four five, one two three")
    prompts = parity_prompts + randoms + [repetitive]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    for sp in (greedy, seeded):
        llm.engine.reset_prefix_cache()
        spec.engine.reset_prefix_cache()
        a = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
        assert a == b
    s = spec.engine.scheduler
    assert s.num_accepted_tokens > 0 and s.num_drafts > 0
