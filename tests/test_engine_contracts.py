"""The engine's contracts, with fake executors (no model): each step's record carries what the
scheduler did, observers read only that record and the scheduler's state, a request is checked
once, and one definition of a decode holds for the packer, the statistics and the profile."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ferry.config import EngineConfig
from ferry.core.clock import ManualClock
from ferry.core.outputs import SchedulerOutput
from ferry.core.sampling_params import SamplingParams
from ferry.core.stats import SchedulerState
from ferry.engine.llm_engine import LLMEngine
from ferry.engine.step_stats import StepStats
from tests.fakes import FakeExecutor

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def run(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()
        engine.clock.advance(0.01)


def test_each_step_record_carries_what_the_scheduler_did_in_it():
    """Preemptions, prefix-cache lookups and drafts, per step, add up to the scheduler's totals."""
    cfg = EngineConfig(max_model_len=4096, block_size=4, max_num_batched_tokens=32, speculative_config=NGRAM,
                       enable_prefix_caching=True)
    engine = LLMEngine(cfg, FakeExecutor(block_size=4, vocab_size=20, repeat=True), num_kv_blocks=14,
                       clock=ManualClock())
    engine.step_stats = []  # every step
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    for i in range(4):
        engine.add_request(shared + [9 + i, 1, 2], SamplingParams(max_tokens=24, ignore_eos=True), request_id=f"r{i}")
    run(engine)
    steps, sched, kv = engine.step_stats, engine.scheduler, engine.kv
    assert sched.num_preemptions > 0 and kv.num_hit_tokens > 0 and sched.num_drafts > 0  # all three happened
    assert sum(s.num_preempted for s in steps) == sched.num_preemptions
    assert sum(s.num_prefix_queried_tokens for s in steps) == kv.num_queried_tokens
    assert sum(s.num_prefix_hit_tokens for s in steps) == kv.num_hit_tokens
    assert sum(s.num_drafts for s in steps) == sched.num_drafts
    assert sum(s.num_draft_tokens for s in steps) == sched.num_draft_tokens
    assert sum(s.num_accepted_tokens for s in steps) == sched.num_accepted_tokens
    assert engine.last_step is steps[-1]
    state = sched.state()
    assert (state.num_running, state.num_waiting, state.num_kv_blocks_used) == (0, 0, 0)
    assert state.num_kv_blocks_free == 14 and state.num_preemptions == sched.num_preemptions


class StepsOnly(SimpleNamespace):
    """An engine as an observer may see it: the step's record and the scheduler's state, no more."""


def test_server_metrics_read_only_the_step_record_and_the_scheduler_state():
    from ferry.server.metrics import ServerMetrics

    load = SchedulerState(num_running=3, num_waiting=2, num_kv_blocks_used=25, num_kv_blocks=100, num_preemptions=9)
    engine = StepsOnly(scheduler=SimpleNamespace(state=lambda: load), last_step=None)
    metrics = ServerMetrics(engine, "m")
    for queried, hits, preempted in ((64, 0, 0), (32, 16, 2), (0, 0, 1)):
        engine.last_step = StepStats(0, 0.1, queried, 0, 0, 1, 5, preempted, num_drafts=2, num_draft_tokens=6,
                                     num_accepted_tokens=3, num_prefix_queried_tokens=queried,
                                     num_prefix_hit_tokens=hits)
        metrics.on_step(engine, [])
    engine.last_step = None  # a step that scheduled nothing counts nothing
    metrics.on_step(engine, [])

    def value(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model_name": "m"})

    assert value("ferry:prefix_cache_queries_total") == 96 and value("ferry:prefix_cache_hits_total") == 16
    assert value("ferry:num_preemptions_total") == 3
    assert (value("ferry:spec_decode_num_drafts_total"), value("ferry:spec_decode_num_draft_tokens_total"),
            value("ferry:spec_decode_num_accepted_tokens_total")) == (6, 18, 9)
    assert value("ferry:spec_decode_acceptance_rate") == 0.5 and value("ferry:spec_decode_mean_accepted_length") == 2.5
    assert (value("ferry:num_requests_running"), value("ferry:num_requests_waiting")) == (3, 2)
    assert (value("ferry:kv_cache_usage_perc"), value("ferry:num_kv_blocks_free")) == (0.25, 75)


class CountingExecutor(FakeExecutor):
    """Counts the executor's own check of each request's sampling settings."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def check_sampling_params(self, sp: SamplingParams) -> None:
        self.checks += 1
        return None


def test_a_request_is_checked_once_on_every_path():
    from ferry.engine.async_engine import AsyncEngine, SubRequest

    ex = CountingExecutor()
    engine = LLMEngine(EngineConfig(max_model_len=256), ex, num_kv_blocks=64, clock=ManualClock())
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    assert ex.checks == 1
    run(engine)

    async def submit_three() -> None:
        front = AsyncEngine(engine)
        front.start()
        sp = SamplingParams(max_tokens=2)
        stream = await front.submit([SubRequest([4, 5, 6], sp, token_ids=[4, 5, 6]) for _ in range(3)])
        async for _ in stream:
            pass
        await front.stop()

    asyncio.run(submit_three())
    assert ex.checks == 1 + 3


class PackingExecutor(FakeExecutor):
    """Packs every step as the model executor does, and keeps what the packer made of it."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.packed: list[tuple[SchedulerOutput, int, int]] = []  # (step, decode rows, all rows)

    def execute(self, out: SchedulerOutput):
        from ferry.executor.batch import pack

        result = super().execute(out)
        batch = pack(out.chunks, self.states, self.block_size)
        self.packed.append((out, batch.meta.num_decodes, batch.input_ids.shape[0]))
        return result


def test_one_definition_of_a_decode_for_the_packer_the_statistics_and_the_profile():
    """A prompt's last token computed alone (chunked prefill) and a verify chunk run as decode
    rows: the step's statistics and its profile shape say so too."""
    from ferry.engine.profiler import StepProfiler

    cfg = EngineConfig(max_model_len=4096, block_size=4, max_num_batched_tokens=16, speculative_config=NGRAM)
    ex = PackingExecutor(block_size=4, vocab_size=20, repeat=True)
    engine = LLMEngine(cfg, ex, num_kv_blocks=64, clock=ManualClock())
    prof = StepProfiler()
    engine.attach_profiler(prof)
    engine.step_stats = []
    engine.add_request(list(range(1, 18)), SamplingParams(max_tokens=12, ignore_eos=True), request_id="a")  # 16 + 1
    engine.add_request([3, 4, 3, 4, 3], SamplingParams(max_tokens=12, ignore_eos=True), request_id="b")
    run(engine)
    assert len(ex.packed) == len(engine.step_stats)
    lone_prompt_tokens = 0
    for (out, decode_rows, rows), stats in zip(ex.packed, engine.step_stats):
        assert stats.num_decode_tokens == decode_rows == out.num_decode_rows  # no padding here
        assert stats.num_prefill_tokens == rows - decode_rows
        assert out.is_decode_step == (decode_rows == rows)
        lone_prompt_tokens += sum(1 for c in out.chunks if c.decode and c.start < 17 and c.request_id == "a")
    assert lone_prompt_tokens == 1  # the case the packer and the statistics used to tell apart
    decode_steps = sum(1 for out, _, _ in ex.packed if out.is_decode_step)
    assert sum(n for shape, n in prof.steps.items() if shape.startswith("decode")) == decode_steps > 0
