"""Scheduling policies: priority preemption (with its anti-thrashing cooldown), aging, and the
partial-prefill caps. Properties over random workloads, with a fake executor."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferry.config import EngineConfig
from ferry.core.kv_cache_manager import blocks_for
from ferry.core.queues import priority_key
from ferry.core.request import Request
from ferry.core.sampling_params import SamplingParams
from ferry.engine.llm_engine import LLMEngine
from tests.test_scheduler import make_engine, run_all

workload = st.lists(  # (prompt length, output length, priority, arrival step)
    st.tuples(st.integers(1, 150), st.integers(1, 30), st.integers(0, 3), st.integers(0, 40)),
    min_size=1, max_size=24)


def feed(engine: LLMEngine, reqs: list, step: int, admitted: dict[str, Request]) -> None:
    for i, (plen, out, prio, at) in enumerate(reqs):
        if at == step:
            admitted[f"r{i}"] = engine.add_request([7 + i] * plen, SamplingParams(max_tokens=out, ignore_eos=True),
                                                   request_id=f"r{i}", priority=prio)


def run_steps(engine: LLMEngine, reqs: list, admitted: dict[str, Request], before=lambda: None):
    """Feed each request at its arrival step and step the engine until every request is done;
    after each step, yield what ``before()`` returned just before it."""
    for step in range(20_000):
        feed(engine, reqs, step, admitted)
        if step > 40 and not engine.has_unfinished():
            return
        seen = before()
        engine.step()
        engine.clock.advance(0.01)
        yield seen
    raise AssertionError("no progress")


def prefill_counts(engine: LLMEngine, out, threshold: int) -> tuple[int, int, list[int]]:
    """Requests mid-prefill during step ``out`` (given the state after it), the long ones among
    them, and the sizes of the step's prefill chunks. A chunk is a prefill if it computes more than
    one token or stops short of the request's end; a running request without a chunk is
    mid-prefill if it has more than one token left to compute."""
    reqs = engine.scheduler.requests
    mid = long = 0
    sizes = []
    chunked = set()
    for c in out.chunks:
        chunked.add(c.request_id)
        if c.num_tokens > 1 or not c.samples:
            sizes.append(c.num_tokens)
            total = c.start + c.num_tokens if c.samples else reqs[c.request_id].num_tokens
            mid += 1
            long += 0 < threshold < total
    for r in engine.scheduler.running:
        if r.request_id not in chunked and r.num_tokens - r.num_computed_tokens > 1:
            mid += 1
            long += 0 < threshold < r.num_tokens
    return mid, long, sizes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workload, budget=st.integers(8, 256), blocks=st.integers(46, 120), max_seqs=st.integers(1, 12),
       partial=st.one_of(st.none(), st.integers(1, 4)), long_cap=st.one_of(st.none(), st.integers(1, 3)),
       threshold=st.sampled_from([0, 16, 40, 100]), policy=st.sampled_from(["fcfs", "priority"]),
       preempt=st.booleans(), cooldown=st.integers(0, 6), aging=st.sampled_from([0.0, 5.0]))
def test_budget_seqs_and_prefill_caps_are_never_exceeded(reqs, budget, blocks, max_seqs, partial, long_cap,
                                                         threshold, policy, preempt, cooldown, aging):
    if long_cap is not None:
        threshold = threshold or 40
        partial = max(partial or 0, long_cap) if partial is not None else None
    if policy == "fcfs":
        preempt, aging = False, 0.0
    engine, ex = make_engine(num_blocks=blocks, block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             max_model_len=200, scheduling_policy=policy, priority_preemption=preempt,
                             priority_preemption_cooldown=cooldown, priority_aging_rate=aging,
                             max_num_partial_prefills=partial, max_long_partial_prefills=long_cap,
                             long_prefill_token_threshold=threshold)
    admitted: dict[str, Request] = {}
    for ran in run_steps(engine, reqs, admitted, before=lambda: len(ex.steps)):
        if len(ex.steps) == ran:
            continue  # nothing ran
        out = ex.steps[-1]
        assert sum(c.num_tokens for c in out.chunks) <= budget
        assert len(engine.scheduler.running) <= max_seqs and len(out.chunks) <= max_seqs
        mid, long, sizes = prefill_counts(engine, out, threshold)
        if partial is not None:
            assert mid <= partial, (mid, partial)
        if long_cap is not None:
            assert long <= long_cap, (long, long_cap)
        if threshold:
            assert all(n <= threshold for n in sizes), (sizes, threshold)
    assert engine.kv.pool.num_free == blocks and not engine.kv.block_tables
    for r in admitted.values():  # nothing lost, nothing cut short
        assert r.status.finish_reason == "length" and r.num_output_tokens == r.max_tokens


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workload, budget=st.integers(8, 128), blocks=st.integers(46, 100), max_seqs=st.integers(1, 6),
       cooldown=st.integers(0, 6), aging=st.sampled_from([0.0, 2.0]))
def test_most_urgent_waiting_request_boards_in_the_next_step_when_preemption_can_make_room(
        reqs, budget, blocks, max_seqs, cooldown, aging):
    """Once a request is the most urgent waiting one, the next step boards it, unless the running
    requests it may not preempt (at least as urgent, or protected by the cooldown) leave it no
    sequence slot, no token of budget or no block."""
    bs = 4
    engine, ex = make_engine(num_blocks=blocks, block_size=bs, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             max_model_len=200, scheduling_policy="priority", priority_preemption=True,
                             priority_preemption_cooldown=cooldown, priority_aging_rate=aging,
                             enable_prefix_caching=False)
    sched = engine.scheduler
    admitted: dict[str, Request] = {}
    for head in run_steps(engine, reqs, admitted, before=lambda: sched.waiting.peek() if sched.waiting else None):
        if head is None or head.status.finished or head in sched.running:
            continue
        out = ex.steps[-1]
        key = priority_key(head, aging)
        if any(priority_key(admitted[rid], aging) < key for rid in out.preempted_req_ids):
            continue  # a more urgent request, preempted for memory, is the most urgent waiting one now
        # Who was running in the step: those still running, and those that finished in it.
        during = set(sched.running) | {admitted[c.request_id] for c in out.chunks}
        kept = [r for r in during
                if priority_key(r, aging) <= key
                or (r.num_preemptions and sched.num_steps - r.boarded_step < cooldown)]
        tokens = sum(out.num_scheduled_tokens.get(r.request_id, 0) for r in kept)
        held = sum(blocks_for(r.num_computed_tokens, bs) for r in kept)
        first = min(head.num_tokens, budget - tokens)
        assert (len(kept) >= max_seqs or tokens >= budget or blocks_for(first, bs) > blocks - held), \
            (f"step {sched.num_steps}: {head.request_id} (priority {head.priority}) was the most urgent waiting "
             f"request and did not board, though less urgent requests held room: "
             f"{[(r.request_id, r.priority) for r in during if r not in kept]}")
    for r in admitted.values():
        assert r.status.finish_reason == "length" and r.num_output_tokens == r.max_tokens


def test_urgent_request_preempts_least_urgent_running_work_and_the_victim_resumes():
    engine, ex = make_engine(num_blocks=64, block_size=4, max_num_seqs=2, scheduling_policy="priority",
                             priority_preemption=True)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request([1] * 8, sp, request_id="low1", priority=2)
    engine.add_request([2] * 8, sp, request_id="low2", priority=1)
    for _ in range(3):
        engine.step()
    engine.add_request([3] * 8, SamplingParams(max_tokens=4, ignore_eos=True), request_id="urgent", priority=0)
    engine.step()
    assert ex.steps[-1].preempted_req_ids == ["low1"]  # the least urgent
    assert "urgent" in ex.steps[-1].num_scheduled_tokens and "low2" in ex.steps[-1].num_scheduled_tokens
    final = run_all(engine)
    assert all(o.outputs[0].finish_reason == "length" for o in final.values()) and len(final) == 3
    # Without priority preemption the urgent request waits for a slot.
    engine, ex = make_engine(num_blocks=64, block_size=4, max_num_seqs=2, scheduling_policy="priority")
    engine.add_request([1] * 8, sp, request_id="low1", priority=2)
    engine.add_request([2] * 8, sp, request_id="low2", priority=1)
    for _ in range(3):
        engine.step()
    engine.add_request([3] * 8, SamplingParams(max_tokens=4, ignore_eos=True), request_id="urgent", priority=0)
    engine.step()
    assert not ex.steps[-1].preempted_req_ids and "urgent" not in ex.steps[-1].num_scheduled_tokens


def test_cooldown_protects_a_request_preempted_before():
    """A stream of urgent requests would preempt the same victim every step; the cooldown lets it
    run ``cooldown`` steps between preemptions."""
    cooldown = 5
    engine, ex = make_engine(num_blocks=64, block_size=4, max_num_seqs=1, scheduling_policy="priority",
                             priority_preemption=True, priority_preemption_cooldown=cooldown)
    engine.add_request([1] * 8, SamplingParams(max_tokens=40, ignore_eos=True), request_id="low", priority=9)
    preempted_at = []
    for step in range(60):
        if step % 2 == 1:
            engine.add_request([2] * 4, SamplingParams(max_tokens=1, ignore_eos=True), request_id=f"u{step}",
                               priority=0)
        engine.step()
        if "low" in ex.steps[-1].preempted_req_ids:
            preempted_at.append(engine.scheduler.num_steps)
    assert len(preempted_at) >= 3
    low = engine.scheduler.requests.get("low")
    gaps = [b - a for a, b in zip(preempted_at, preempted_at[1:])]
    assert all(g > cooldown for g in gaps), gaps
    assert low is None or low.num_output_tokens > 0


def _starvation_run(aging: float, steps: int = 400) -> list[Request]:
    """One normal request against an endless stream of urgent ones that alone fill the engine
    (one arrives every step, each needs 3 steps, one sequence at a time). Returns the normal
    request, then the urgent ones."""
    engine, _ = make_engine(num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=16,
                            scheduling_policy="priority", priority_preemption=True, priority_aging_rate=aging)
    reqs = [engine.add_request([1] * 8, SamplingParams(max_tokens=4, ignore_eos=True), request_id="normal",
                               priority=3)]
    for step in range(steps):
        reqs.append(engine.add_request([2] * 8, SamplingParams(max_tokens=3, ignore_eos=True),
                                       request_id=f"u{step}", priority=0))
        engine.step()
        engine.clock.advance(0.01)
    return reqs


def test_without_aging_sustained_urgent_load_starves_a_normal_request_and_with_aging_it_finishes():
    assert not _starvation_run(aging=0.0)[0].status.finished
    normal, *urgent = _starvation_run(aging=10.0)
    assert normal.status.finish_reason == "length"
    # 10 levels per second: the normal request (priority 3) is more urgent than urgent requests
    # (priority 0) that arrived more than 0.3 s after it, and boards before all of them.
    later = [u for u in urgent if u.arrival_time > normal.arrival_time + 0.3 + 1e-9]
    assert later and all(u.times.first_scheduled is None or u.times.first_scheduled > normal.times.first_scheduled
                         for u in later)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workload, budget=st.integers(8, 128), blocks=st.integers(46, 100), max_seqs=st.integers(1, 6),
       aging=st.sampled_from([0.5, 2.0, 10.0]), preempt=st.booleans())
def test_with_aging_no_request_is_overtaken_by_one_arriving_long_after_it(reqs, budget, blocks, max_seqs, aging,
                                                                          preempt):
    """Aging bounds every wait: a request of priority p is first scheduled no later than any
    request arriving more than (p - lowest priority) / rate seconds after it."""
    engine, ex = make_engine(num_blocks=blocks, block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             max_model_len=200, scheduling_policy="priority", priority_aging_rate=aging,
                             priority_preemption=preempt)
    admitted: dict[str, Request] = {}
    for _ in run_steps(engine, reqs, admitted):
        pass
    lowest = min(r.priority for r in admitted.values())
    for x in admitted.values():
        for y in admitted.values():
            if y.arrival_time > x.arrival_time + (x.priority - lowest) / aging + 1e-9:
                assert x.times.first_scheduled <= y.times.first_scheduled, (x.request_id, y.request_id)


def test_short_prompts_behind_a_long_one_board_at_once_with_caps():
    """A long prompt takes the whole budget, step after step, and short prompts behind it wait; with
    the threshold, each of its chunks leaves room, and a second long prompt over the long cap
    lets the short ones pass it."""
    def first_token_steps(**caps) -> dict[str, int]:
        engine, ex = make_engine(num_blocks=400, block_size=16, max_num_batched_tokens=256, **caps)
        sp = SamplingParams(max_tokens=2, ignore_eos=True)
        engine.add_request([1] * 2000, sp, request_id="long1")
        engine.add_request([2] * 2000, sp, request_id="long2")
        engine.step()
        for i in range(3):
            engine.add_request([3 + i] * 20, sp, request_id=f"short{i}")
        first = {}
        step = 1
        while engine.has_unfinished():
            step += 1
            for o in engine.step():
                first.setdefault(o.request_id, step)
        return first

    off = first_token_steps()
    on = first_token_steps(long_prefill_token_threshold=128, max_num_partial_prefills=4, max_long_partial_prefills=1)
    assert min(off[f"short{i}"] for i in range(3)) > 15  # behind 4000 prompt tokens at 256 a step
    assert max(on[f"short{i}"] for i in range(3)) <= 3
    assert on["long1"] < on["long2"]  # the long cap: one long prompt at a time


def test_partial_prefill_cap_stops_admission_and_bad_settings_are_named():
    engine, ex = make_engine(num_blocks=400, max_num_batched_tokens=512, max_num_partial_prefills=2)
    for i in range(4):
        engine.add_request([1 + i] * 300, SamplingParams(max_tokens=2, ignore_eos=True), request_id=f"p{i}")
    engine.step()
    assert sorted(ex.steps[-1].num_scheduled_tokens) == ["p0", "p1"]
    with pytest.raises(ValueError, match="priority_preemption needs scheduling_policy='priority'"):
        EngineConfig(priority_preemption=True)
    with pytest.raises(ValueError, match="max_long_partial_prefills needs long_prefill_token_threshold"):
        EngineConfig(max_long_partial_prefills=1)
    with pytest.raises(ValueError, match=r"max_long_partial_prefills \(3\) must be <= max_num_partial_prefills \(2\)"):
        EngineConfig(max_num_partial_prefills=2, max_long_partial_prefills=3, long_prefill_token_threshold=10)
    with pytest.raises(ValueError, match="max_num_partial_prefills must be an integer >= 1"):
        EngineConfig(max_num_partial_prefills=0)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        EngineConfig(long_prefill_token_threshold=10, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="continuous scheduler"):
        EngineConfig(scheduler="static", max_num_partial_prefills=1)


def test_priority_preemption_counts_shared_cached_blocks_and_preempts_only_when_it_makes_room():
    """4 blocks of 16 tokens. W (most urgent) holds 1 block, V (least urgent) 3, the first two a
    cached 32-token prefix X. U wants X + 20 tokens: after preempting V it would need 2 new blocks
    plus X's 2 blocks back from the free pool, 4 > 3: preempting V gains nothing, so V keeps
    running. Once W has finished, the same preemption makes room, and U boards in that very step."""
    engine, ex = make_engine(num_blocks=4, block_size=16, scheduling_policy="priority", priority_preemption=True,
                             max_num_batched_tokens=128)
    x = list(range(100, 132))
    engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=6, ignore_eos=True), request_id="W", priority=0)
    engine.add_request(x + list(range(200, 208)), SamplingParams(max_tokens=8, ignore_eos=True), request_id="V",
                       priority=5)
    engine.step()
    assert engine.kv.pool.num_free == 0
    engine.add_request(x + list(range(300, 320)), SamplingParams(max_tokens=10, ignore_eos=True), request_id="U",
                       priority=1)
    boarded_with_preemption = False
    for _ in range(20):
        engine.step()
        out = ex.steps[-1]
        if "W" in engine.scheduler.requests:
            assert not out.preempted_req_ids, "V was preempted while U could not board anyway"
        if "V" in out.preempted_req_ids:
            assert "U" in out.num_scheduled_tokens  # the room made is taken in the same step
            boarded_with_preemption = True
            break
    assert boarded_with_preemption
    final = run_all(engine)
    assert {o.outputs[0].finish_reason for o in final.values()} == {"length"}
