"""Scheduler behaviour and properties, with a fake executor: no model, no torch."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferry.config import EngineConfig
from ferry.core.request import Request
from ferry.core.sampling_params import SamplingParams
from ferry.core.clock import ManualClock
from ferry.engine.llm_engine import LLMEngine
from tests.fakes import FakeExecutor


def make_engine(num_blocks: int = 64, **kw) -> tuple[LLMEngine, FakeExecutor]:
    kw.setdefault("max_model_len", 4096)
    cfg = EngineConfig(**kw)
    ex = FakeExecutor(block_size=cfg.block_size)
    return LLMEngine(cfg, ex, num_kv_blocks=num_blocks, clock=ManualClock()), ex


def run_all(engine: LLMEngine, max_steps: int = 100_000) -> dict:
    """Step until every request is done; returns each request's final output by id."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.clock.advance(0.01)
    raise AssertionError("requests did not finish")


def test_long_prompt_is_chunked_by_the_budget_alone():
    engine, ex = make_engine(max_num_batched_tokens=64)
    engine.add_request(list(range(1, 201)), SamplingParams(max_tokens=3, ignore_eos=True), request_id="a")
    run_all(engine)
    sizes = [s.num_scheduled_tokens["a"] for s in ex.steps]
    assert sizes == [64, 64, 64, 8, 1, 1]


def test_running_requests_board_before_waiting_ones():
    engine, ex = make_engine(max_num_batched_tokens=10)
    engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=5, ignore_eos=True), request_id="a")
    engine.step()
    engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=5, ignore_eos=True), request_id="b")
    engine.step()
    assert ex.steps[-1].num_scheduled_tokens == {"a": 1, "b": 9}


def test_preemption_frees_blocks_requeues_at_head_and_admits_nobody():
    engine, ex = make_engine(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request([1] * 8, sp, request_id="a")
    engine.add_request([2] * 8, sp, request_id="b")
    engine.add_request([3] * 4, sp, request_id="c")
    run_all(engine)
    preempting = [s for s in ex.steps if s.preempted_req_ids]
    assert preempting, "the cache is too small for all three: someone must be preempted"
    for s in preempting:
        assert not s.new_req_ids
        assert not set(s.preempted_req_ids) & set(s.num_scheduled_tokens)
    first = preempting[0].preempted_req_ids[0]
    assert first == "c"  # the last to arrive goes first
    assert engine.kv.pool.num_free == 6


def test_priority_policy_preempts_least_urgent_and_admits_urgent_first():
    engine, ex = make_engine(num_blocks=64, scheduling_policy="priority", max_num_seqs=1)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request([1, 2], sp, request_id="low", priority=5)
    engine.add_request([1, 2], sp, request_id="high", priority=-1)
    engine.step()
    assert list(ex.steps[0].num_scheduled_tokens) == ["high"]


def test_without_chunked_prefill_a_prompt_boards_whole_or_waits():
    engine, ex = make_engine(max_num_batched_tokens=100, enable_chunked_prefill=False, max_model_len=100)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request([1] * 60, sp, request_id="a")
    engine.add_request([1] * 60, sp, request_id="b")
    engine.step()
    assert ex.steps[0].num_scheduled_tokens == {"a": 60}


def test_chunked_prefill_off_needs_budget_of_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_engine(max_num_batched_tokens=64, enable_chunked_prefill=False, max_model_len=128)


def test_request_that_can_never_fit_is_refused_with_numbers():
    engine, _ = make_engine(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) plus max_tokens \(60\) is 70 tokens.*64"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=60))
    with pytest.raises(ValueError, match=r"needs 5 KV blocks.*4 blocks"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=10))
    engine.add_request([1] * 10, SamplingParams(max_tokens=6, ignore_eos=True), request_id="ok")
    run_all(engine)


def test_abort_returns_blocks_at_once_and_unknown_id_is_an_error():
    engine, _ = make_engine(num_blocks=24, block_size=4)
    engine.add_request([1] * 20, SamplingParams(max_tokens=50, ignore_eos=True), request_id="a")
    engine.add_request([1] * 8, SamplingParams(max_tokens=4, ignore_eos=True), request_id="b")
    engine.step()
    assert engine.kv.pool.num_used == 5 + 2  # 20 and 8 prompt tokens, 4 a block
    engine.abort("a")
    assert "a" not in engine.kv.block_tables
    with pytest.raises(KeyError, match="nope"):
        engine.abort("nope")
    run_all(engine)
    assert engine.kv.pool.num_free == 24


def test_static_batch_keeps_finished_slots_until_the_batch_ends():
    engine, ex = make_engine(scheduler="static", max_num_seqs=4, num_blocks=256)
    lengths = [2, 5, 9, 20]
    for i, n in enumerate(lengths):
        engine.add_request([1 + i] * 10, SamplingParams(max_tokens=n, ignore_eos=True), request_id=f"r{i}")
    engine.add_request([9] * 10, SamplingParams(max_tokens=3, ignore_eos=True), request_id="next")
    run_all(engine)
    first_batch = ex.steps[:max(lengths)]
    assert all(len(s.chunks) == 4 for s in first_batch), "every slot is computed until the batch ends"
    assert "next" not in {c.request_id for s in first_batch for c in s.chunks}
    padding = sum(s.num_padding_tokens for s in first_batch)
    assert padding == sum(max(lengths) - n for n in lengths)
    assert engine.kv.pool.num_free == 256


# ---------------------------------------------------------------- properties over random workloads
workload = st.lists(
    st.tuples(st.integers(1, 120), st.integers(1, 40), st.integers(0, 3), st.integers(0, 6)),
    min_size=1, max_size=24)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workload, budget=st.integers(1, 256), blocks=st.integers(12, 80), block_size=st.sampled_from([1, 4, 16]),
       max_seqs=st.integers(1, 16), policy=st.sampled_from(["fcfs", "priority"]),
       chunked=st.booleans(), abort_some=st.booleans())
def test_scheduler_invariants(reqs, budget, blocks, block_size, max_seqs, policy, chunked, abort_some):
    max_model_len = 200
    if not chunked:
        budget = max(budget, max_model_len)
    engine, ex = make_engine(num_blocks=blocks, block_size=block_size, max_num_batched_tokens=budget,
                             max_num_seqs=max_seqs, scheduling_policy=policy, enable_chunked_prefill=chunked,
                             max_model_len=max_model_len)
    admitted = []
    pending = list(enumerate(reqs))
    step = 0
    aborted = set()
    while pending or engine.has_unfinished():
        # Requests arrive over time, a few per step.
        for _ in range(2):
            if pending:
                i, (plen, out, prio, _) = pending.pop(0)
                try:
                    admitted.append(engine.add_request([7 + i] * plen, SamplingParams(max_tokens=out, ignore_eos=True),
                                                       request_id=f"r{i}", priority=prio))
                except ValueError:
                    assert (plen + out + block_size - 1) // block_size > blocks or plen + out > max_model_len
        running_before = {r.request_id for r in engine.scheduler.running}
        engine.step()
        engine.clock.advance(0.01)
        step += 1
        assert step < 20_000, "no progress"
        if not ex.steps:
            continue
        out = ex.steps[-1]
        sched = out.num_scheduled_tokens
        assert sum(sched.values()) <= budget
        if out.preempted_req_ids:
            assert not out.new_req_ids
        # Every running request is considered before any waiting one: a newcomer boards
        # only if every request that was running (and not preempted) boarded too.
        if out.new_req_ids:
            still = running_before - set(out.preempted_req_ids)
            assert still <= set(sched), (still, sched)
        owners: dict[int, str] = {}
        for rid, table in engine.kv.block_tables.items():
            for b in table:
                assert b not in owners, f"block {b} owned by {owners[b]} and {rid}"
                owners[b] = rid
        if abort_some and step % 7 == 0 and engine.scheduler.running:
            victim = engine.scheduler.running[0].request_id
            engine.abort(victim)
            aborted.add(victim)
    assert not engine.has_unfinished()
    assert engine.kv.pool.num_free == blocks and not engine.kv.block_tables
    for r in admitted:
        if r.request_id in aborted:
            assert r.status.finish_reason == "abort"
        else:
            assert r.status.finish_reason == "length"
            assert r.num_output_tokens == r.max_tokens


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 12), plen=st.integers(1, 60), budget=st.integers(1, 128))
def test_fcfs_first_tokens_come_in_arrival_order(n, plen, budget):
    engine, _ = make_engine(max_num_batched_tokens=budget, num_blocks=400)
    reqs = [engine.add_request([5] * plen, SamplingParams(max_tokens=3, ignore_eos=True), request_id=f"r{i}")
            for i in range(n)]
    run_all(engine)
    firsts = [r.times.first_token for r in reqs]
    assert firsts == sorted(firsts)


class CharDetokenizer:
    """Token t decodes to the t-th piece of a fixed script, so tests control the text exactly."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def append(self, token_id: int) -> str:
        return self.pieces[token_id % len(self.pieces)]


@pytest.mark.parametrize("stop,expected", [("c d", "ab "), ("zz", None), ("abc", None), ("d e", "ab c ")])
def test_stop_string_spanning_tokens_truncates_text(stop, expected):
    pieces = ["a", "b", " c", " d", " e", "f"]
    engine, ex = make_engine()

    def fixed(out):  # token i of the output is i: the text is "ab c d ef"
        res = FakeExecutor.execute(ex, out)
        for rid in res.sampled:
            res.sampled[rid] = [engine.scheduler.requests[rid].num_output_tokens]
        return res

    engine.executor.execute = fixed
    req = Request("s", [1, 2, 3], SamplingParams(max_tokens=6, stop=[stop], ignore_eos=True), arrival_time=0.0)
    engine.scheduler.add_request(req)
    engine.output_processor.add_request(req, None)
    engine.output_processor.states["s"].detokenizer = CharDetokenizer(pieces)
    output_text = run_all(engine)["s"].outputs[0].text
    if expected is None:
        assert req.status.finish_reason == "length" and output_text == "ab c d ef"
    else:
        assert req.status.finish_reason == "stop" and req.stop_reason == stop
        assert output_text == expected


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.text("ab ", min_size=1, max_size=3), min_size=1, max_size=6),
       stops=st.lists(st.text("ab ", min_size=1, max_size=4), min_size=1, max_size=3),
       n=st.integers(1, 12), include=st.booleans())
def test_streamed_text_never_shows_what_a_stop_string_later_cuts(pieces, stops, n, include):
    """The output processor holds back what could start a stop string: every output's text is a
    prefix of the final text, which ends where the first stop string begins (or after it)."""
    engine, ex = make_engine()

    def fixed(out):  # output token i decodes to pieces[i]
        res = FakeExecutor.execute(ex, out)
        for rid in res.sampled:
            res.sampled[rid] = [engine.scheduler.requests[rid].num_output_tokens]
        return res

    engine.executor.execute = fixed
    sp = SamplingParams(max_tokens=n, stop=stops, ignore_eos=True, include_stop_str_in_output=include)
    req = Request("s", [1, 2, 3], sp, arrival_time=0.0)
    engine.scheduler.add_request(req)
    engine.output_processor.add_request(req, None)
    engine.output_processor.states["s"].detokenizer = CharDetokenizer(pieces)
    texts = []
    while engine.has_unfinished():
        texts += [o.outputs[0].text for o in engine.step()]
    final, whole = texts[-1], "".join(pieces[i % len(pieces)] for i in range(n))
    assert all(final.startswith(t) for t in texts)
    assert all(len(a) <= len(b) for a, b in zip(texts, texts[1:]))
    # The reference: the earliest stop string to end in the text, as the text grew token by token.
    text, want = "", whole
    for i in range(n):
        text += pieces[i % len(pieces)]
        hits = [(text.find(s), k, s) for k, s in enumerate(stops) if s in text]
        if hits:  # the earliest, ties to the first listed
            at, _, s = min(hits)
            want = text[:at + len(s)] if include else text[:at]
            break
    assert final == want


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on():
    engine, ex = make_engine(num_blocks=64, max_num_batched_tokens=8)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    a = engine.add_request([1] * 8, sp, request_id="a")  # fills the first step's budget alone
    real = ex.execute
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(out)

    engine.executor.execute = flaky
    outs = engine.step()
    assert [o.request_id for o in outs] == ["a"] and outs[0].outputs[0].finish_reason == "error"
    assert "boom" in str(a.stop_reason) and "a" not in engine.kv.block_tables
    b = engine.add_request([2] * 4, sp, request_id="b")
    run_all(engine)
    assert b.status.finish_reason == "length" and b.num_output_tokens == 3
    assert engine.kv.pool.num_free == 64
