"""Metric maths on hand-built timelines, with exact expected values."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ferry.engine.metrics import percentile, summarize
from ferry.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ferry.engine.step_stats import StepStats


def out(rid: str, arrival: float, scheduled: float | None, tokens: list[float], finish: str = "length",
        prompt_len: int = 10, preemptions: int = 0, recomputed: int = 0) -> RequestOutput:
    finished = tokens[-1] if tokens else (scheduled if scheduled is not None else arrival) + 1.0
    return RequestOutput(rid, None, list(range(prompt_len)),
                         [CompletionOutput(0, "", list(range(len(tokens))), finish_reason=finish)], True,
                         RequestMetrics(arrival, scheduled, tokens[0] if tokens else None, finished, tokens,
                                        preemptions, recomputed))


def step(start: float, prefill: int = 0, decode: int = 0, padding: int = 0, blocks: int = 0) -> StepStats:
    return StepStats(start, 0.1, prefill, decode, padding, 1, blocks, 0)


def test_latencies_from_a_hand_built_timeline():
    outs = [
        out("a", 0.0, 0.5, [1.0, 1.5, 2.0, 3.0]),   # ttft 1.0, tpot 2/3, itl .5 .5 1, e2e 3, queue .5
        out("b", 1.0, 1.0, [2.0]),                    # 1 token: ttft 1.0, no tpot, no itl, e2e 1
        out("c", 2.0, 2.5, [4.0, 4.5], prompt_len=5),  # ttft 2.0, tpot .5, itl .5, e2e 2.5
    ]
    m = summarize(outs, duration=5.0)
    assert m.completed == 3 and m.total_input_tokens == 25 and m.total_output_tokens == 7
    assert m.samples["ttft"] == [1.0, 1.0, 2.0]
    assert m.samples["tpot"] == pytest.approx([2 / 3, 0.5])  # the 1-token request has no TPOT
    assert m.samples["itl"] == [0.5, 0.5, 1.0, 0.5]
    assert m.samples["e2el"] == [3.0, 1.0, 2.5]
    assert m.samples["queue"] == [0.5, 0.0, 0.5]
    d = m.to_dict()
    assert d["request_throughput"] == pytest.approx(0.6)
    assert d["output_throughput"] == pytest.approx(1.4)
    assert d["total_token_throughput"] == pytest.approx(32 / 5)
    assert d["mean_ttft_ms"] == pytest.approx(4000 / 3)
    assert d["median_ttft_ms"] == pytest.approx(1000.0)
    # numpy's linear interpolation: p90 of [1, 1, 2] is at rank 1.8 -> 1 + 0.8 * (2 - 1)
    assert d["p90_ttft_ms"] == pytest.approx(1800.0)
    assert d["p99_ttft_ms"] == pytest.approx(1980.0)
    assert d["mean_tpot_ms"] == pytest.approx((2 / 3 + 0.5) / 2 * 1000)
    assert d["median_itl_ms"] == pytest.approx(500.0)
    assert d["max_itl_ms"] == pytest.approx(1000.0)
    assert d["p95_e2el_ms"] == pytest.approx((2.5 + 0.9 * 0.5) * 1000)  # rank 1.9 of [1, 2.5, 3]


def test_tpot_is_e2e_minus_ttft_over_tokens_minus_one():
    m = out("a", 0.0, 0.0, [0.4, 0.7, 1.3, 1.6, 2.2]).metrics
    assert (m.ttft, m.e2e) == (0.4, 2.2)
    assert m.tpot == pytest.approx(0.45)  # (2.2 - 0.4) / 4
    assert out("b", 0, 0, [0.3]).metrics.tpot is None


def test_aborted_and_failed_requests_are_counted_but_not_in_latencies_or_throughput():
    outs = [out("ok", 0, 0, [1.0, 2.0]), out("ab", 0, 0, [0.5], finish="abort"),
            out("er", 0, None, [], finish="error")]
    m = summarize(outs, 2.0)
    assert (m.completed, m.num_aborted, m.num_failed) == (1, 1, 1)
    assert m.total_output_tokens == 2 and m.samples["ttft"] == [1.0]


def test_preemptions_and_recompute_count_against_slot_utilisation():
    outs = [out("a", 0, 0, [1.0, 2.0], preemptions=2, recomputed=30), out("b", 0, 0, [1.0, 2.0])]
    steps = [step(0.0, prefill=100, blocks=4), step(1.0, prefill=30, decode=1, blocks=8),
             step(2.0, decode=2, padding=3, blocks=2)]
    m = summarize(outs, 3.0, steps, num_kv_blocks=8)
    assert m.num_preemptions == 2
    assert m.num_computed_tokens == 136
    assert m.slot_utilization == pytest.approx(1 - (3 + 30) / 136)
    assert m.generation_slot_utilization == pytest.approx(4 / 7)
    assert m.mean_kv_usage == pytest.approx(14 / 24) and m.max_kv_usage == 1.0
    assert m.num_steps == 3


def test_static_waste_of_one_long_request_among_short_ones():
    """n requests held for max(L) generation slots each waste 1 - sum(L) / (n * max L): here one of
    2000 tokens and 31 of 40 use 3240 of 64000 slots, and 60760 slot-steps sit idle."""
    lens = [2000] + [40] * 31
    outs = [out(str(i), 0, 0, [float(k) for k in range(n)]) for i, n in enumerate(lens)]
    m = summarize(outs, 1.0, [step(0.0, decode=3240, padding=60760)])
    assert m.total_output_tokens == 3240
    assert m.generation_slot_utilization == pytest.approx(0.050625)


def test_percentile_and_empty_figures():
    assert percentile([], 99) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    m = summarize([], 1.0)
    d = m.to_dict()
    assert d["completed"] == 0 and d["mean_ttft_ms"] is None and d["slot_utilization"] is None
    assert all(isinstance(line, str) for line in m.lines())


def test_json_has_the_serving_benchmark_names():
    d = summarize([out("a", 0, 0, [1.0, 2.0, 3.5])], 4.0).to_dict()
    for name in ("completed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
                 "max_itl_ms", "num_preemptions", "slot_utilization"):
        assert name in d
    for stat in ("mean", "median", "p90", "p95", "p99"):
        for lat in ("ttft", "tpot", "itl", "e2el"):
            assert f"{stat}_{lat}_ms" in d
    assert not any(isinstance(v, float) and math.isnan(v) for v in d.values())
    assert np.isclose(d["p99_itl_ms"], 1000 + 0.99 * 500)
