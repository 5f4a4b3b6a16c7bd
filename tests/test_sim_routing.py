"""Data-parallel replicas in simulation (ferry/sim/replicas.py) behind the router, the shared-prefix
workload, and ``ferry simulate route``."""
from __future__ import annotations

import json

import pytest

from ferry.bench.workload import shared_prefix_workload
from ferry.cli import main
from ferry.config import EngineConfig
from ferry.server import router as router_mod
from ferry.server.router import RouterConfig
from ferry.sim.engine import SimEngineFactory
from ferry.sim.hardware import load_hardware
from ferry.sim.models import load_model_config
from ferry.sim.replicas import run_replicas

DP = 4
CONFIG = EngineConfig(max_num_batched_tokens=256, dtype="bfloat16")
FACTORY = SimEngineFactory(load_model_config("smollm2-135m"), load_hardware("l4"))
# 6 shared prefixes of 8 blocks, 16-token suffixes, arriving about one per step (~3 ms here), so
# arrivals land while steps are in flight and requests overlap on each replica.
REQS = shared_prefix_workload(120, num_groups=6, prefix_len=128, suffix_len=16, output_len=12, request_rate=300,
                              group_skew=0.5, seed=3, vocab_size=FACTORY.model.vocab_size)


def run(policy: str, reqs=REQS):
    return run_replicas(FACTORY, CONFIG, reqs, DP, RouterConfig(policy=policy, block_size=CONFIG.block_size))


@pytest.fixture(scope="module")
def runs():
    return {p: run(p) for p in router_mod.POLICIES}


def test_shared_prefix_workload():
    again = shared_prefix_workload(120, 6, 128, 16, 12, 300, 0.5, 3, FACTORY.model.vocab_size)
    assert [(r.prompt_token_ids, r.arrival_time) for r in again] == [(r.prompt_token_ids, r.arrival_time) for r in REQS]
    assert all(len(r.prompt_token_ids) == 144 and r.max_tokens == 12 for r in REQS)
    prefixes = {tuple(r.prompt_token_ids[:128]) for r in REQS}
    assert len(prefixes) <= 6 and len({tuple(r.prompt_token_ids[128:]) for r in REQS}) == 120
    times = [r.arrival_time for r in REQS]
    assert times == sorted(times) and 0 < times[0] and times[-1] == pytest.approx(120 / 300, rel=0.3)
    # Zipf skew: the first group is the most popular; 0 is uniform-ish.
    skewed = shared_prefix_workload(2000, 8, 16, 1, 1, group_skew=2.0, seed=0)
    counts = sorted((sum(1 for r in skewed if tuple(r.prompt_token_ids[:16]) == p) for p in
                     {tuple(r.prompt_token_ids[:16]) for r in skewed}), reverse=True)
    assert counts[0] > 0.5 * 2000 and all(r.arrival_time == 0 for r in skewed)
    with pytest.raises(ValueError, match="num_groups"):
        shared_prefix_workload(10, 0, 16, 1, 1)
    with pytest.raises(ValueError, match="group_skew"):
        shared_prefix_workload(10, 2, 16, 1, 1, group_skew=-1)


@pytest.mark.parametrize("policy", router_mod.POLICIES)
def test_every_request_finishes_once_with_its_tokens(runs, policy):
    r = runs[policy]
    assert [o.request_id for o in r.outputs] == [str(i) for i in range(len(REQS))]
    assert all(len(o.outputs[0].token_ids) == req.max_tokens and o.outputs[0].finish_reason == "length"
               for o, req in zip(r.outputs, REQS))
    assert r.metrics.completed == len(REQS) and sum(s.num_requests for s in r.replicas) == len(REQS)
    assert [sum(1 for a in r.assignment if a == i) for i in range(DP)] == [s.num_requests for s in r.replicas]
    # Each request ran on the replica it was routed to, and only there.
    for replica, steps in enumerate(r.steps):
        ran = {rid for s in steps for rid in s.prefill_ids + s.decode_ids}
        assert ran == {str(i) for i, a in enumerate(r.assignment) if a == replica}
    assert r.duration == pytest.approx(max(o.metrics.finished_time for o in r.outputs))


@pytest.mark.parametrize("policy", router_mod.POLICIES)
def test_no_request_starts_before_its_arrival(runs, policy):
    r = runs[policy]
    arrival = {str(i): q.arrival_time for i, q in enumerate(REQS)}
    for steps in r.steps:
        starts = [s.start for s in steps]
        assert starts == sorted(starts)  # one replica: one step at a time
        assert all(a.start + a.duration <= b.start + 1e-12 for a, b in zip(steps, steps[1:]))
        for s in steps:
            assert all(s.start >= arrival[rid] for rid in s.prefill_ids + s.decode_ids)
    assert all(o.metrics.arrival_time == arrival[o.request_id] for o in r.outputs)
    assert all(o.metrics.queue_time >= 0 for o in r.outputs)
    # The replicas overlap in time (one timeline, not one after another).
    assert max(steps[0].start for steps in r.steps) < min(steps[-1].start for steps in r.steps)


def test_arrivals_are_routed_in_time_order_with_the_state_as_of_their_arrival(monkeypatch):
    """When request i (arriving at t) is routed, the router counts on each replica exactly the
    requests routed there earlier that had not finished by t: nothing later is known yet."""
    seen: list[tuple[list[int], list[int]]] = []
    route = router_mod.Router.route

    def spy(self, token_ids, exclude=frozenset()):
        seen.append((token_ids, [v.num_requests for v in self.replicas]))
        return route(self, token_ids, exclude)

    monkeypatch.setattr(router_mod.Router, "route", spy)
    r = run("least_loaded")
    order = sorted(range(len(REQS)), key=lambda i: REQS[i].arrival_time)
    assert [tokens for tokens, _ in seen] == [REQS[i].prompt_token_ids for i in order]
    finished = [o.metrics.finished_time for o in r.outputs]
    overlapping = 0
    for k, i in enumerate(order):
        t = REQS[i].arrival_time
        expect = [0] * DP
        for j in order[:k]:
            if finished[j] > t:  # a request that finished at t exactly is already off the books
                expect[r.assignment[j]] += 1
        assert seen[k][1] == expect, f"request {i} at {t}"
        overlapping += any(s.start < t < s.start + s.duration for s in r.steps[r.assignment[i]])
    assert overlapping > 10  # the property was tested where it matters: arrivals mid-step


def test_prefix_aware_hits_the_cache_more_than_round_robin(runs):
    rate = {p: runs[p].metrics.prefix_cache_hit_rate for p in runs}
    assert rate["prefix_aware"] > rate["round_robin"] + 0.1
    # The per-replica counters of the KV cache managers agree with the requests' own counts.
    for r in runs.values():
        assert sum(s.num_hit_tokens for s in r.replicas) == r.metrics.num_cached_tokens
        assert sum(s.num_queried_tokens for s in r.replicas) == r.metrics.total_input_tokens
    assert [s.num_requests for s in runs["round_robin"].replicas] == [len(REQS) // DP] * DP


def test_an_idle_replica_jumps_to_the_arrival():
    # Two requests far apart: each replica idles, then starts at the arrival, not at 0.
    reqs = shared_prefix_workload(2, 1, 32, 4, 3, seed=0)
    reqs[0].arrival_time, reqs[1].arrival_time = 5.0, 9.0
    r = run("round_robin", reqs)
    assert [steps[0].start for steps in r.steps[:2]] == [5.0, 9.0] and not r.steps[2]
    assert r.duration > 9.0 and r.replicas[2].busy_time == 0
    assert all(o.metrics.ttft < 0.1 for o in r.outputs)


def test_cli_route_end_to_end(tmp_path, capsys):
    out = tmp_path / "route.json"
    rc = main(["simulate", "route", "--model", "smollm2-135m", "--hardware", "l4", "--dp", "3", "--policies", "all",
               "--num-prompts", "40", "--num-groups", "4", "--prefix-len", "64", "--suffix-len", "8",
               "--output-len", "4", "--request-rate", "200", "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| policy | TTFT p50 / p99 (ms)" in text
    assert all(f"| {p} |" in text for p in router_mod.POLICIES)
    data = json.loads(out.read_text())
    assert data["data_parallel_size"] == 3 and [r["policy"] for r in data["runs"]] == list(router_mod.POLICIES)
    for r in data["runs"]:
        assert r["completed"] == 40 and len(r["replicas"]) == 3
        assert r["min_requests_per_replica"] <= r["max_requests_per_replica"]
        assert sum(x["num_requests"] for x in r["replicas"]) == 40
    # One policy, from --router-policy; bad lists and --dp outside route are refused.
    assert main(["simulate", "route", "--model", "smollm2-135m", "--hardware", "l4", "--dp", "2",
                 "--router-policy", "round_robin", "--num-prompts", "4", "--prefix-len", "16", "--suffix-len", "4",
                 "--output-len", "2"]) == 0
    assert "| round_robin |" in capsys.readouterr().out
    assert main(["simulate", "route", "--policies", "round_robin,random", "--num-prompts", "4"]) == 2
    assert main(["simulate", "--dp", "2", "--num-prompts", "4"]) == 2
    assert "route" in capsys.readouterr().err
