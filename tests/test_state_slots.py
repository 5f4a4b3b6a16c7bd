"""Recurrent-state slots beside the KV blocks (hybrid models): the core with a fake executor whose
"state" in each slot is the identity of the tokens it has consumed, so a state used after it was
freed, not carried across a chunk edge, or copied from a snapshot of another prefix fails; as
properties over random arrivals, aborts and preemptions with heavy prefix sharing."""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferry.config import EngineConfig
from ferry.core.clock import ManualClock
from ferry.core.outputs import ModelRunnerOutput, SchedulerOutput
from ferry.core.sampling_params import SamplingParams
from ferry.engine.llm_engine import LLMEngine
from tests.fakes import FakeExecutor
from tests.test_prefix_caching import BS, shared_prefix_workload
from tests.test_prefix_caching import run as run_with_blocks_checked


class FakeStateExecutor(FakeExecutor):
    """A FakeExecutor whose model also keeps a recurrent state per request in a slot."""

    def __init__(self, num_state_slots: int, **kw) -> None:
        super().__init__(block_size=BS, **kw)
        self.num_state_slots = num_state_slots
        self.state: dict[int, tuple[int, ...]] = {}  # slot -> the tokens its state has consumed

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.states.apply(out)
        for src, dst in out.state_copies:  # requests starting from a snapshot
            self.state[dst] = self.state[src]
        for c in out.chunks:
            r = self.states[c.request_id]
            tokens = tuple(r.all_token_ids)
            assert 0 <= c.state_slot < self.num_state_slots
            before = () if c.start == 0 else self.state.get(c.state_slot)
            assert before == tokens[:c.start], f"{c.request_id}: its state at {c.start} is not its own prefix's"
            end = c.start + c.num_tokens
            self.state[c.state_slot] = tokens[:end]
            if c.snapshot_slot >= 0:
                assert c.snapshot_slot != c.state_slot and end % BS == 0
                self.state[c.snapshot_slot] = tokens[:end]
        return super().execute(out)


def make_engine(num_blocks: int, slots: int, caching: bool = True, **kw) -> tuple[LLMEngine, FakeStateExecutor]:
    cfg = EngineConfig(max_model_len=4096, block_size=BS, enable_prefix_caching=caching, **kw)
    ex = FakeStateExecutor(slots)
    return LLMEngine(cfg, ex, num_kv_blocks=num_blocks, clock=ManualClock()), ex


def check_states(engine: LLMEngine) -> None:
    """Each running request holds one slot, nobody else does; every snapshot belongs to a cached block."""
    states, pool = engine.kv.states, engine.kv.states.pool
    assert set(states.slots) == set(engine.kv.block_tables)
    held = list(states.slots.values()) + [s.slot for s in states.snapshots.values()] + \
        [c[0] for c in states.copies.values()]
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == held.count(b), f"slot {b}: {pool.ref_counts[b]} refs, {held.count(b)} holders"
    assert len(set(states.slots.values())) == len(states.slots), "two requests share a slot"
    for h in pool.cached:
        assert h in engine.kv.pool.cached, "a snapshot outlived its block"


def run(engine: LLMEngine, work: list[tuple[list[int], int]], rng: random.Random, abort_rate: float) -> dict:
    """test_prefix_caching's run (arrivals, aborts, block invariants) with the state invariants every
    step too; the finished requests' outputs."""
    return run_with_blocks_checked(engine, work, rng, abort_rate, check=check_states)[0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(16, 60), slots=st.integers(1, 8),
       budget=st.integers(4, 48), interval=st.sampled_from([BS, 2 * BS, 3 * BS]),
       abort_rate=st.sampled_from([0.0, 0.1]))
def test_states_are_carried_kept_and_freed_under_random_traffic(seed, num_blocks, slots, budget, interval, abort_rate):
    work = shared_prefix_workload(random.Random(seed), 24)
    on, ex = make_engine(num_blocks, slots, max_num_batched_tokens=budget, state_snapshot_interval=interval)
    off, _ = make_engine(num_blocks, slots, caching=False, max_num_batched_tokens=budget)
    final_on, final_off = run(on, work, random.Random(seed), abort_rate), run(off, work, random.Random(seed), abort_rate)
    assert not [o for o in final_on.values() if o.outputs[0].finish_reason == "error"], "a step failed"
    for rid, out in final_on.items():
        if out.outputs[0].finish_reason == "length" and final_off[rid].outputs[0].finish_reason == "length":
            assert out.outputs[0].token_ids == final_off[rid].outputs[0].token_ids
    # No state leaked: only snapshots remain, and they are free to evict.
    assert on.kv.states.num_used == 0 and not on.kv.states.slots
    # A chunk never crosses a snapshot point.
    for s in ex.steps:
        for c in s.chunks:
            nxt = (c.start // interval + 1) * interval
            assert c.start + c.num_tokens <= nxt


def test_a_second_turn_resumes_from_the_deepest_snapshot_and_counts_the_hit():
    engine, ex = make_engine(64, 8, max_num_batched_tokens=64, state_snapshot_interval=2 * BS)
    history = [(5 * i + 1) % 40 + 1 for i in range(9 * BS + 2)]  # 9 full blocks and 2 tokens
    engine.add_request(history, SamplingParams(max_tokens=3, ignore_eos=True), request_id="a")
    while engine.has_unfinished():
        engine.step()
    chunk_ends = [c.start + c.num_tokens for s in ex.steps for c in s.chunks]
    # Cut at every snapshot point (8, 16, 24, 32) and at the prompt's last full block (36).
    assert chunk_ends[:6] == [2 * BS, 4 * BS, 6 * BS, 8 * BS, 9 * BS, 9 * BS + 2]
    ex.steps.clear()
    b = engine.add_request(history + [3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True), request_id="b")
    engine.step()
    first = ex.steps[0]
    assert first.chunks[0].start == 9 * BS and b.num_cached_tokens == 9 * BS  # the prompt-end snapshot
    assert len(first.state_copies) == 1
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_hit_tokens == 9 * BS


def test_without_a_snapshot_a_cached_prefix_is_not_reused():
    """KV blocks alone cannot restore a recurrent state: a hit needs the state kept where it ends."""
    engine, ex = make_engine(64, 4, max_num_batched_tokens=64, state_snapshot_interval=64 * BS)
    prompt = list(range(1, 4 * BS + 2))
    engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), request_id="a")
    while engine.has_unfinished():
        engine.step()
    engine.kv.states.reset()  # the blocks stay cached, the snapshots go
    b = engine.add_request(prompt + [9], SamplingParams(max_tokens=1, ignore_eos=True), request_id="b")
    engine.step()
    assert b.num_cached_tokens == 0 and ex.steps[-1].chunks[0].start == 0


def test_snapshots_leave_with_their_blocks():
    engine, _ = make_engine(12, 8, max_num_batched_tokens=64, state_snapshot_interval=2 * BS)
    engine.add_request(list(range(1, 6 * BS + 1)), SamplingParams(max_tokens=1, ignore_eos=True), request_id="a")
    while engine.has_unfinished():
        engine.step()
    kept = set(engine.kv.states.pool.cached)
    assert kept
    # Another prompt needs every block: the cached ones are evicted, and their snapshots with them.
    engine.add_request(list(range(100, 100 + 11 * BS)), SamplingParams(max_tokens=1, ignore_eos=True),
                       request_id="b")
    while engine.has_unfinished():
        engine.step()
        check_states(engine)
    assert not kept & set(engine.kv.pool.cached) and not kept & set(engine.kv.states.pool.cached)


def test_no_free_slot_waits_and_speculation_stays_off():
    engine, ex = make_engine(64, 1, max_num_batched_tokens=64,
                             speculative_config=dict(method="ngram", num_speculative_tokens=3))
    for i in range(3):
        engine.add_request([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=6, ignore_eos=True), request_id=f"r{i}")
    while engine.has_unfinished():
        engine.step()
        assert len(engine.scheduler.running) <= 1
    assert all(not c.spec_token_ids for s in ex.steps for c in s.chunks)
