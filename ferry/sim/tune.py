"""SLO tuning in simulation: search the scheduler's knobs, keep the highest throughput that meets the SLO."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferry.bench.runner import BenchRun
from ferry.bench.sweep import best_under_slo, meets_slo, run_sweep
from ferry.bench.workload import WorkloadRequest
from ferry.config import EngineConfig

TUNE_GRID: dict[str, list[Any]] = {
    "max_num_batched_tokens": [256, 512, 1024, 2048, 4096, 8192],
    "max_num_seqs": [32, 64, 128, 256, 512],
    "enable_chunked_prefill": [True, False],
}


@dataclass
class TuneResult:
    runs: list[BenchRun]
    points: list[dict[str, Any]]
    skipped: list[str]
    best: dict[str, Any] | None
    frontier: list[dict[str, Any]]  # no other point is better on throughput and both p99 latencies


def pareto_frontier(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points not dominated in (higher output throughput, lower p99 TTFT, lower p99 TPOT)."""
    def key(p: dict[str, Any]) -> tuple[float, float, float]:
        inf = float("inf")
        return (-p["output_throughput"], p["p99_ttft_ms"] if p["p99_ttft_ms"] is not None else inf,
                p["p99_tpot_ms"] if p["p99_tpot_ms"] is not None else inf)

    def dominates(a: tuple, b: tuple) -> bool:
        return all(x <= y for x, y in zip(a, b)) and a != b

    keys = [key(p) for p in points]
    front = [p for p, k in zip(points, keys) if not any(dominates(o, k) for o in keys)]
    return sorted(front, key=lambda p: -p["output_throughput"])


def tune(base: EngineConfig, requests: list[WorkloadRequest], rate: float | None, slo: dict[str, float],
         factory: Any, grid: dict[str, list[Any]] | None = None, progress: bool = False) -> TuneResult:
    """Run every configuration of ``grid`` on ``factory`` (a simulator) at ``rate``; pick the best."""
    grid = grid or TUNE_GRID
    runs, skipped = run_sweep(base, requests, grid, [rate], factory=factory, progress=progress)
    points = [r.to_dict() for r in runs]
    return TuneResult(runs, points, skipped, best_under_slo(points, slo), pareto_frontier(points))


def ranked_within_slo(points: list[dict[str, Any]], slo: dict[str, float]) -> list[dict[str, Any]]:
    return sorted((p for p in points if meets_slo(p, slo)), key=lambda p: -p["output_throughput"])
