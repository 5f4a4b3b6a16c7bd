"""The rule that picks each verify's draft length (``ferry.core.spec_k``): expected tokens, the
choice against brute force, k shrinking as the batch grows, the acceptance EWMA, and the
scheduler carrying ``1 + k_chosen`` tokens per verify (fake executor)."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.config import EngineConfig
from ferry.core.sampling_params import SamplingParams
from ferry.core.spec_k import AcceptanceTracker, StepCost, expected_tokens
from ferry.engine.draft_lengths import choose_ks
from tests.test_spec_decode import NGRAM, make_engine

rates = st.floats(0.0, 1.0, allow_nan=False)
def _linear(base: float, row: float) -> tuple:
    """Two points of a line: time ``1 + row * (rows - 1)`` (times ``base`` for the draft)."""
    return ((1, base), (100, base + row * 99))


# Linear step times: the choice is then provably the optimum, checked against brute force.
costs = st.builds(lambda r, ds, dr: StepCost(target=_linear(1.0, r), draft=_linear(ds, dr), verify=((1, 0.0),)),
                  st.floats(0.0, 0.5), st.floats(0.0, 0.6), st.floats(0.0, 0.1))


@given(a=rates, k=st.integers(0, 8))
def test_expected_tokens_is_the_sum_of_acceptance_powers(a, k):
    assert expected_tokens(a, k) == pytest.approx(sum(a ** j for j in range(k + 1)))
    assert 1.0 <= expected_tokens(a, k) <= k + 1 + 1e-9


def _ratio(acc, ks, cost, other):
    return (other + sum(expected_tokens(a, k) for a, k in zip(acc, ks))) / cost.of(other + len(acc), ks)


@settings(max_examples=200, deadline=None)
@given(acc=st.lists(rates, min_size=1, max_size=3), cap=st.integers(0, 3), cost=costs, other=st.integers(0, 20))
def test_the_choice_is_the_best_of_every_draft_length(acc, cap, cost, other):
    caps = [cap] * len(acc)
    ks = choose_ks(acc, caps, cost, other)
    assert all(0 <= k <= c for k, c in zip(ks, caps))
    best = max(_ratio(acc, list(c), cost, other) for c in itertools.product(range(cap + 1), repeat=len(acc)))
    assert _ratio(acc, ks, cost, other) == pytest.approx(best, rel=1e-9)


def _piecewise(steps: list) -> tuple:
    """Increasing (rows, time) points from (rows, time step) pairs."""
    points, total = {}, 0.0
    for rows, dt in sorted(dict(steps).items()):
        total += dt
        points[rows] = total
    return tuple(points.items())


piecewise = st.lists(st.tuples(st.integers(1, 12), st.floats(0.0, 3.0)), min_size=1, max_size=4).map(_piecewise)
positive = st.lists(st.tuples(st.integers(1, 12), st.floats(0.01, 3.0)), min_size=1, max_size=4).map(_piecewise)


@settings(max_examples=300, deadline=None)
@given(acc=st.lists(st.sampled_from([0.0, 0.3, 0.7, 1.0]) | rates, min_size=1, max_size=4),
       data=st.data(), target=positive, draft=piecewise, verify=piecewise, other=st.integers(0, 6))
def test_the_choice_is_exact_for_any_measured_costs_and_caps(acc, data, target, draft, verify, other):
    # Step times neither linear nor convex, each request its own cap (some near their ends).
    caps = data.draw(st.lists(st.integers(0, 3), min_size=len(acc), max_size=len(acc)))
    cost = StepCost(target=target, draft=draft, verify=verify)
    ks = choose_ks(acc, caps, cost, other)
    assert all(0 <= k <= c for k, c in zip(ks, caps))
    best = max(_ratio(acc, list(c), cost, other) for c in itertools.product(*(range(c + 1) for c in caps)))
    assert _ratio(acc, ks, cost, other) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("step", [0.05, 0.3, 0.6, 1.2])
def test_the_choice_is_exact_when_one_request_may_draft_longer_than_the_rest(step):
    # Five requests near their ends (cap 1) and one with cap 3: its draft steps 2 and 3 run alone.
    # Rows nearly free, draft steps not: its poor later drafts do not pay for the steps they add.
    acc, caps = [0.95, 0.3, 0.95, 0.9, 0.95, 0.85], [1, 3, 1, 1, 1, 1]
    cost = StepCost(target=_linear(1.0, 0.01), draft=((1, step), (8, step + 0.1)), verify=((1, 0.05),))
    ks = choose_ks(acc, caps, cost, 0)
    best = max(_ratio(acc, list(c), cost, 0) for c in itertools.product(*(range(c + 1) for c in caps)))
    assert _ratio(acc, ks, cost, 0) == pytest.approx(best, rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(a=rates, cost=costs, k=st.integers(1, 6))
def test_drafts_never_grow_with_the_batch(a, cost, k):
    per_request = [sum(choose_ks([a] * n, [k] * n, cost)) / n for n in (1, 2, 4, 8, 16, 64)]
    assert all(x >= y - 1e-9 for x, y in zip(per_request, per_request[1:]))


def test_speculation_turns_off_under_load_and_for_poor_drafts():
    cost = StepCost()  # measured here: the float32 SmolLM2-135M and its Q4_1 draft
    assert choose_ks([0.9], [4], cost) == [4]  # one request, a good draft: the whole k
    assert sum(choose_ks([0.9] * 16, [4] * 16, cost)) == 0  # sixteen: none
    assert choose_ks([0.05], [4], cost) == [0]  # a draft that is almost never right: none
    assert choose_ks([], [], cost) == []
    # Better drafts earn longer runs in the same step.
    ks = choose_ks([0.95, 0.5], [6, 6], StepCost(target=_linear(1.0, 0.05), draft=_linear(0.1, 0.01), verify=((1, 0),)))
    assert ks[0] > ks[1]


def test_a_large_batch_is_answered_by_the_bound_without_the_exact_search(monkeypatch):
    """Sixty-four requests, the measured costs, the prior acceptance (near ends too): the cheap bound
    proves no drafts, so the step never builds the search's tables."""
    import ferry.engine.draft_lengths as spec_k

    def no_search(*args, **kwargs):
        raise AssertionError("the exact search ran")

    monkeypatch.setattr(spec_k, "_StepDP", no_search)
    for a in (0.3, 0.8, 0.85):
        assert choose_ks([a] * 64, [4] * 64, StepCost()) == [0] * 64
        assert choose_ks([a] * 64, [4] * 60 + [1, 2, 3, 0], StepCost(), other_rows=32) == [0] * 64


@settings(max_examples=100, deadline=None)
@given(acc=st.lists(rates, min_size=1, max_size=6), cap=st.integers(0, 4))
def test_with_the_measured_costs_the_choice_beats_every_uniform_k(acc, cap):
    cost = StepCost()
    ks = choose_ks(acc, [cap] * len(acc), cost)
    assert all(_ratio(acc, ks, cost, 0) >= _ratio(acc, [k] * len(acc), cost, 0) - 1e-9 for k in range(cap + 1))


def test_acceptance_is_an_ewma_of_the_outcomes():
    t = AcceptanceTracker(prior=0.5, weight=0.5, recover=0.5)
    assert t.rate("r") == 0.5
    t.observe("r", 3, 3)  # three accepted: 0.75, 0.875, 0.9375
    assert t.rate("r") == pytest.approx(0.9375)
    t.observe("r", 3, 0)  # the first rejected ends the run: one outcome
    assert t.rate("r") == pytest.approx(0.46875)
    t.idle("r")  # measured by nothing: back toward the engine-wide rate, not up toward 1
    assert t.rate("r") == pytest.approx(0.46875 + 0.5 * (t.overall - 0.46875))
    for _ in range(40):
        t.idle("r")
    assert t.rate("r") == pytest.approx(t.overall)
    t.forget("r")
    assert t.rate("r") == t.overall


def test_step_cost_is_checked_and_parsed_from_the_config():
    spec = EngineConfig(speculative_config={"method": "ngram", "adaptive_k": True,
                                            "step_cost": {"target": [[4, 2], [1, 1]]}}).speculative_config
    assert spec.step_cost == StepCost(target=((1, 1), (4, 2)), draft=((1, 0),), verify=((1, 0),))  # n-gram: free drafts
    assert spec.step_cost.of(7, []) == pytest.approx(3.0)  # past the last point: the last slope
    for bad, word in [({"adaptive_k": 1}, "adaptive_k"), ({"step_cost": {"target": [[0, 1]]}}, "step_cost.target"),
                      ({"step_cost": {"target": [[1, 0]]}}, "times > 0"),
                      ({"step_cost": {"draft": [[1, 0.5], [4, 0.4]]}}, "cannot take less time"),
                      ({"step_cost": {"rows": 1}}, "unknown"), ({"step_cost": 3}, "step_cost"),
                      ({"step_cost": {"draft": [1, 2]}}, "step_cost.draft")]:
        with pytest.raises(ValueError, match=word):
            EngineConfig(speculative_config={"method": "ngram", **bad})


def _verify_lengths(n: int, spec: dict) -> list[int]:
    """Draft lengths of the verify chunks while ``n`` requests decode repetitive text together."""
    engine, ex = make_engine(spec, num_blocks=400, max_num_batched_tokens=512, max_num_seqs=64)
    for i in range(n):
        engine.add_request([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], SamplingParams(max_tokens=24, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return [len(c.spec_token_ids) for s in ex.steps for c in s.chunks if c.num_tokens - len(c.spec_token_ids) == 1]


def test_the_scheduler_carries_the_chosen_k_and_stops_drafting_under_load():
    adaptive = dict(NGRAM, num_speculative_tokens=4, adaptive_k=True, step_cost={"target": [[1, 1], [2, 1.4]]})
    alone = _verify_lengths(1, adaptive)
    assert max(alone) == 4 and sum(alone) > 0  # one request, always accepted: the whole k
    crowd = _verify_lengths(48, adaptive)
    assert sum(crowd) == 0  # 48 requests: every extra row costs more than it brings
    assert sum(_verify_lengths(48, dict(adaptive, adaptive_k=False))) > 0  # fixed k drafts regardless
