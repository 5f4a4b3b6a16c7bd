"""Data-parallel replicas in simulation: N engines on one simulated timeline, fed by the router.

Each replica is an ordinary simulated LLMEngine with its own clock; the router
(``ferry.server.router``, the one the real server front uses) picks a replica for each arrival.
A small discrete-event loop keeps the replicas' clocks consistent with each other:

- a replica is either idle or has one step in flight, from its clock's reading when the step
  began to the reading after it (the engine's executor advances that clock);
- events run in time order: the end of a step (the router learns which requests finished and
  the replica's KV usage: what it would know at that moment) and arrivals (routed with the
  router's state as of the arrival, then queued on that replica). On a tie a step's end comes
  first, so a request finishing at t is off the books for an arrival at t;
- a replica whose step ends with work left starts its next step at once; an idle replica that
  gets a request first moves its clock to the arrival, then steps.

A step runs eagerly (its outputs are known when it starts), but what the router hears of it is
delivered at its end, so no arrival is routed on news from the future.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from ferry.bench.workload import WorkloadRequest
from ferry.config import EngineConfig
from ferry.core.sampling_params import SamplingParams
from ferry.core.clock import ManualClock
from ferry.engine.llm_engine import LLMEngine
from ferry.engine.metrics import RunMetrics, summarize
from ferry.engine.outputs import RequestOutput
from ferry.engine.step_stats import StepStats
from ferry.server.router import Router, RouterConfig


@dataclass
class ReplicaStats:
    """What one replica did in a run."""

    num_requests: int = 0  # routed there
    num_hit_tokens: int = 0  # prompt tokens its prefix cache supplied (``engine.kv``'s counters)
    num_queried_tokens: int = 0  # prompt tokens looked up there
    busy_time: float = 0.0  # seconds spent in steps

    def to_dict(self) -> dict[str, Any]:
        return {"num_requests": self.num_requests, "num_hit_tokens": self.num_hit_tokens,
                "num_queried_tokens": self.num_queried_tokens, "busy_time": self.busy_time}


@dataclass
class ReplicaRun:
    """One workload through N routed replicas: outputs in request order, the replica each request
    went to, per-replica counts, and the figures over all of them (``summarize``'s)."""

    policy: str
    outputs: list[RequestOutput]
    assignment: list[int]  # request index -> replica
    replicas: list[ReplicaStats]
    duration: float  # from 0 to the end of the last step
    metrics: RunMetrics
    steps: list[list[StepStats]] = field(repr=False, default_factory=list)  # per replica

    def to_dict(self) -> dict[str, Any]:
        counts = [r.num_requests for r in self.replicas]
        return {"policy": self.policy, "num_replicas": len(self.replicas),
                "min_requests_per_replica": min(counts), "max_requests_per_replica": max(counts),
                **self.metrics.to_dict(), "replicas": [r.to_dict() for r in self.replicas]}


# Event kinds, in the order they run at the same instant.
_STEP_END, _ARRIVAL = 0, 1


def run_replicas(factory: Any, config: EngineConfig, requests: list[WorkloadRequest], num_replicas: int,
                 router_config: RouterConfig) -> ReplicaRun:
    """Serve ``requests`` (arrival times in seconds from 0) on ``num_replicas`` engines from
    ``factory`` (``engine(config)`` with a fresh ManualClock at 0 each, as SimEngineFactory gives),
    routed by ``router_config``. Greedy, ignore_eos: each request yields exactly ``max_tokens``."""
    engines: list[LLMEngine] = [factory.engine(config) for _ in range(num_replicas)]
    for e in engines:
        if not isinstance(e.clock, ManualClock) or e.clock() != 0.0:
            raise ValueError("run_replicas needs fresh simulated engines (a ManualClock at 0)")
        e.step_stats = []  # every step of the run
    router = Router(num_replicas, router_config)
    stats = [ReplicaStats() for _ in range(num_replicas)]
    assignment = [-1] * len(requests)
    final: dict[str, RequestOutput] = {}
    in_flight = [False] * num_replicas
    # (time, kind, tiebreak, payload): a step end carries (replica, finished count, KV usage).
    events: list[tuple[float, int, int, Any]] = [(r.arrival_time, _ARRIVAL, i, i) for i, r in enumerate(requests)]
    heapq.heapify(events)

    def start_step(r: int) -> None:
        """Run replica r's next step now; the router hears of it when it ends."""
        e = engines[r]
        begin, n_steps = e.clock(), len(e.step_stats)
        done = [o for o in e.step(finished_only=True) if o.finished]
        if len(e.step_stats) == n_steps:  # nothing could board: idle until a new arrival
            in_flight[r] = False
            return
        for o in done:
            final[o.request_id] = o
        stats[r].busy_time += e.clock() - begin
        in_flight[r] = True
        heapq.heappush(events, (e.clock(), _STEP_END, r, (r, len(done), e.kv.usage)))

    while events:
        t, kind, _, payload = heapq.heappop(events)
        if kind == _STEP_END:
            r, num_done, usage = payload
            for _ in range(num_done):
                router.finished(r)
            router.report(r, usage)
            in_flight[r] = False
            if engines[r].has_unfinished():
                start_step(r)
            continue
        i = payload
        req = requests[i]
        r = assignment[i] = router.route(req.prompt_token_ids)
        stats[r].num_requests += 1
        e = engines[r]
        if not in_flight[r]:
            e.clock.sleep_until(t)
        e.add_request(req.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True),
                      request_id=str(i), arrival_time=t, priority=req.priority)
        if not in_flight[r]:
            start_step(r)
    stuck = [r for r, e in enumerate(engines) if e.has_unfinished()]
    if stuck:
        raise RuntimeError(f"replicas {stuck} have unfinished requests but schedule nothing")
    for s, e in zip(stats, engines):
        s.num_hit_tokens, s.num_queried_tokens = e.kv.num_hit_tokens, e.kv.num_queried_tokens
    outputs = [final[str(i)] for i in range(len(requests))]
    duration = max(e.clock() for e in engines)
    all_steps = [s for e in engines for s in e.step_stats]
    # Every replica has the same KV size (one factory, one config), so usage per step is comparable.
    metrics = summarize(outputs, duration, all_steps, engines[0].num_kv_blocks)
    return ReplicaRun(router_config.policy, outputs, assignment, stats, duration, metrics,
                      [list(e.step_stats) for e in engines])


def route_table(runs: list[ReplicaRun]) -> list[str]:
    """A markdown table, one row per policy (latencies in ms)."""
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v * 1e3:.0f}" if v >= 1 else f"{v * 1e3:.1f}"

    rows = ["| policy | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | output tok/s | prefix cache hit rate | "
            "requests per replica (min / max) |", "|---|---|---|---|---|---|"]
    for run in runs:
        m, counts = run.metrics, [r.num_requests for r in run.replicas]
        hit = "n/a" if m.prefix_cache_hit_rate is None else f"{m.prefix_cache_hit_rate:.1%}"
        rows.append(f"| {run.policy} | {ms(m.stat('ttft', 'median'))} / {ms(m.stat('ttft', 'p99'))} | "
                    f"{ms(m.stat('tpot', 'median'))} / {ms(m.stat('tpot', 'p99'))} | {m.output_throughput:.0f} | "
                    f"{hit} | {min(counts)} / {max(counts)} |")
    return rows
