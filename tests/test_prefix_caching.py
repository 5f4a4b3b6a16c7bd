"""Automatic prefix caching: the core with a fake executor that checks every KV slot it reads,
as properties over random workloads with heavy prefix sharing; then the real model."""
from __future__ import annotations

import random
from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferry.config import EngineConfig
from ferry.core.block_pool import BlockPool
from ferry.core.kv_cache_manager import KVCacheManager, hash_block
from ferry.core.request import Request
from ferry.core.sampling_params import SamplingParams
from ferry.core.clock import ManualClock
from ferry.engine.llm_engine import LLMEngine
from tests.fakes import FakeExecutor


@pytest.fixture(scope="module")
def llm(exact_llm):
    """Exact products, so a cached prefix must give the very same tokens."""
    return exact_llm


BS = 4


def make_engine(num_blocks: int, caching: bool = True, **kw) -> tuple[LLMEngine, FakeExecutor]:
    cfg = EngineConfig(max_model_len=4096, block_size=BS, enable_prefix_caching=caching, **kw)
    ex = FakeExecutor(block_size=BS)
    return LLMEngine(cfg, ex, num_kv_blocks=num_blocks, clock=ManualClock()), ex


def check_blocks(engine: LLMEngine) -> None:
    """Every block a live request holds is referenced exactly once per table holding it and is
    not free; every other block is free."""
    pool = engine.kv.pool
    holders = [0] * pool.num_blocks
    for table in engine.kv.block_tables.values():
        for b in table:
            holders[b] += 1
    free = set(pool._free) | set(pool._cached_free)
    assert len(free) == pool.num_free, "a block is free twice"
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == holders[b], f"block {b}: {pool.ref_counts[b]} refs, {holders[b]} holders"
        assert (b in free) == (holders[b] == 0), f"block {b} free while referenced, or lost"
    for h, b in pool.cached.items():
        assert pool.block_hash[b] == h


def shared_prefix_workload(rng: random.Random, n: int) -> list[tuple[list[int], int]]:
    """Requests that share a few long prefixes (cut at random points) plus short own suffixes.
    The prefixes are made of the same few block-sized pieces in different orders, so equal
    blocks sit behind different prefixes: only a hash of the whole chain tells them apart."""
    pieces = [[rng.randrange(1, 50) for _ in range(BS)] for _ in range(3)]
    bases = [sum((rng.choice(pieces) for _ in range(rng.randint(2, 10))), []) for _ in range(6)]
    out = []
    for _ in range(n):
        base = rng.choice(bases)
        prompt = base[:rng.randint(1, len(base))] + [rng.randrange(1, 50) for _ in range(rng.randint(0, 6))]
        out.append((prompt, rng.randint(1, 12)))
    return out


def run(engine: LLMEngine, work: list[tuple[list[int], int]], rng: random.Random, abort_rate: float = 0.0,
        check: Callable[[LLMEngine], None] | None = None) -> tuple[dict, list[Request]]:
    """Requests arrive a few per step; some are aborted at random. Block invariants every step, and
    ``check(engine)`` after them when given."""
    pending = list(enumerate(work))
    final, reqs = {}, []
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i, (prompt, n) = pending.pop(0)
                reqs.append(engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                                               request_id=f"r{i}"))
        live = list(engine.scheduler.requests)
        if live and rng.random() < abort_rate:
            rid = rng.choice(live)
            final[rid] = engine.abort(rid)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        check_blocks(engine)
        if check is not None:
            check(engine)
        engine.clock.advance(0.01)
    return final, reqs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(16, 60), budget=st.integers(4, 48),
       abort_rate=st.sampled_from([0.0, 0.0, 0.1]))
def test_caching_changes_no_output_and_keeps_every_block_accounted_for(seed, num_blocks, budget, abort_rate):
    work = shared_prefix_workload(random.Random(seed), 24)
    on, ex = make_engine(num_blocks, max_num_batched_tokens=budget)
    off, _ = make_engine(num_blocks, caching=False, max_num_batched_tokens=budget)
    final_on, reqs = run(on, work, random.Random(seed), abort_rate)
    final_off, _ = run(off, work, random.Random(seed), abort_rate)
    assert not [o for o in final_on.values() if o.outputs[0].finish_reason == "error"], "a step failed"
    # Aborts land on different requests when the schedules differ: compare the ones both finished.
    for rid, out in final_on.items():
        if out.outputs[0].finish_reason == "length" and final_off[rid].outputs[0].finish_reason == "length":
            assert out.outputs[0].token_ids == final_off[rid].outputs[0].token_ids
    # Everything is free at the end (cached blocks are free, evictable).
    assert on.kv.pool.num_used == 0 and not on.kv.block_tables
    assert all(rc == 0 for rc in on.kv.pool.ref_counts)
    # Hit accounting is exact: every token a residency counted as computed was either scheduled
    # in a chunk or taken from the cache, and the cache counter holds exactly the latter.
    scheduled = sum(c.num_tokens for s in ex.steps for c in s.chunks if not c.padding)
    drafted_away = 0  # no speculation here
    assert scheduled - drafted_away + on.kv.num_hit_tokens == \
        sum(r.num_computed_tokens + r.num_recomputed_tokens for r in reqs)
    assert on.kv.num_hit_tokens <= on.kv.num_queried_tokens


def test_a_repeated_prompt_computes_only_its_last_token():
    engine, ex = make_engine(64)
    prompt = list(range(1, 4 * BS + 1))  # 4 full blocks
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request(prompt, sp, request_id="a")
    while engine.has_unfinished():
        engine.step()
    ex.steps.clear()
    b = engine.add_request(prompt, sp, request_id="b")
    while engine.has_unfinished():
        engine.step()
    first = ex.steps[0].chunks[0]
    # The whole prompt is cached, but its last token is computed again: its logits are needed.
    assert (first.start, first.num_tokens) == (3 * BS, BS)
    assert b.num_cached_tokens == 3 * BS
    assert engine.kv.num_hit_tokens == 3 * BS and engine.kv.num_queried_tokens == 2 * 4 * BS


def test_a_shared_block_is_freed_only_when_its_last_holder_leaves():
    engine, _ = make_engine(64)
    prefix = list(range(1, 2 * BS + 1))
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request(prefix + [7], sp, request_id="a")
    engine.step()  # a's prefix is computed and cached
    engine.add_request(prefix + [9], sp, request_id="b")
    engine.step()
    shared = engine.kv.block_tables["a"][:2]
    assert engine.kv.block_tables["b"][:2] == shared
    assert all(engine.kv.pool.ref_counts[x] == 2 for x in shared)
    engine.abort("a")
    assert all(engine.kv.pool.ref_counts[x] == 1 for x in shared)
    check_blocks(engine)


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(4)
    a, b = pool.take(2), pool.take(2)
    for blk, h in zip(a + b, (b"a0", b"a1", b"b0", b"b1")):
        pool.cache(blk, h)
    pool.give_back(a)
    pool.give_back(b)
    assert pool.num_free == 4 and len(pool.cached) == 4
    pool.take(1)  # a's tail goes first: a request's last block is its least shareable
    assert pool.lookup(b"a1") is None and pool.lookup(b"a0") == a[0]
    pool.touch([b[0]])  # reused: no longer evictable
    pool.take(2)
    assert pool.lookup(b"b0") == b[0] and pool.lookup(b"a0") is None and pool.lookup(b"b1") is None


def test_never_cached_blocks_are_taken_before_any_cached_one_is_evicted():
    pool = BlockPool(4)
    x = pool.take(1)
    pool.cache(x[0], b"x")
    pool.give_back(x)
    assert len(pool.take(3)) == 3 and pool.lookup(b"x") == x[0]


def test_hash_chain_depends_on_everything_before():
    h1 = hash_block(b"", [1, 2, 3, 4])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(hash_block(b"", [1, 2, 3, 5]), [5, 6, 7, 8])
    assert hash_block(b"", [1, 2, 3, 4], extra=b"lora-1") != h1


def test_prompt_logprobs_requests_reuse_nothing():
    kv = KVCacheManager(16, BS, enable_caching=True)
    r = Request("a", list(range(1, 13)), SamplingParams(), arrival_time=0.0)
    kv.allocate_slots(r, 12)
    r.num_computed_tokens = 12
    kv.cache_blocks(r)
    again = Request("b", list(range(1, 13)), SamplingParams(), arrival_time=0.0)
    assert len(kv.find_cached(again)) == 2
    scored = Request("c", list(range(1, 13)), SamplingParams(prompt_logprobs=1), arrival_time=0.0)
    assert kv.find_cached(scored) == []


def test_reset_forgets_cached_prefixes_but_not_blocks_in_use():
    engine, ex = make_engine(64)
    prompt = list(range(1, 3 * BS + 1))
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request(prompt, sp, request_id="a")
    while engine.has_unfinished():
        engine.step()
    assert engine.reset_prefix_cache() == 3  # the prompt's 3 full blocks (the last generated token has no KV)
    ex.steps.clear()
    engine.add_request(prompt, sp, request_id="b")
    engine.step()
    assert ex.steps[0].chunks[0].start == 0  # computed from scratch
    check_blocks(engine)


def test_static_baseline_neither_reuses_nor_caches():
    engine, ex = make_engine(64, scheduler="static", max_num_seqs=2)
    prompt = list(range(1, 3 * BS + 1))
    for i in range(4):
        engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), request_id=f"s{i}")
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_hit_tokens == 0 and not engine.kv.pool.cached
    assert all(c.start == 0 for s in ex.steps for c in s.chunks if c.request_id in s.new_req_ids)


# ------------------------------------------------------------------ the real model
def test_cached_prefixes_give_the_same_tokens_on_the_model(llm, parity_prompts):
    """Caching on: the second pass reuses the first's blocks and gives the same greedy tokens as
    the first pass (computed from scratch) and as an engine with caching off."""
    from ferry import LLM

    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.engine.reset_prefix_cache()
    shared = parity_prompts[7][:200]
    prompts = [shared + p[:40] for p in parity_prompts]  # one 200-token prefix, 8 suffixes
    cold = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    hits = llm.engine.kv.num_hit_tokens
    warm_outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.engine.kv.num_hit_tokens - hits >= 8 * 192
    assert all(o.metrics.num_cached_tokens >= 192 for o in warm_outs)
    assert [o.outputs[0].token_ids for o in warm_outs] == cold
    off = LLM(quant_activations="exact", enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)] == cold
    assert off.engine.kv.num_hit_tokens == 0
    llm.engine.reset_prefix_cache()


def test_the_simulator_runs_the_same_cache_so_hits_cost_nothing():
    from ferry.bench.runner import run_workload
    from ferry.bench.workload import WorkloadRequest
    from ferry.sim.engine import SimEngineFactory
    from ferry.sim.hardware import load_hardware
    from ferry.sim.models import load_model_config

    system = list(range(100, 700))  # a 600-token shared prefix
    reqs = [WorkloadRequest(system + [1000 + i] * 20, 8, arrival_time=0.5 * i) for i in range(8)]
    f = SimEngineFactory(load_model_config("llama-3.1-8b"), load_hardware("h100-sxm"))
    runs = {on: run_workload(f.engine(EngineConfig(enable_prefix_caching=on)), reqs, progress=False) for on in (True, False)}
    prefill = {on: sum(s.num_prefill_tokens for s in r.steps) for on, r in runs.items()}
    assert runs[True].metrics.num_cached_tokens == 7 * 592 and runs[False].metrics.num_cached_tokens == 0
    assert prefill[False] - prefill[True] == 7 * 592
    assert runs[True].metrics.duration < runs[False].metrics.duration
