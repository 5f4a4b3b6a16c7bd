"""Sweeps over engine settings and request rates, and the tuning rule: among the
configurations that meet the latency SLO, take the one with the highest throughput."""
from __future__ import annotations

import itertools
import logging
from typing import Any, Callable

from ferry.bench.runner import BenchRun, EngineFactory, engine_config, run_workload
from ferry.bench.workload import WorkloadRequest, with_request_rate
from ferry.config import EngineConfig

log = logging.getLogger(__name__)

# Engine settings a sweep can vary, and how to read one value of each.
SWEEPABLE: dict[str, Callable[[str], Any]] = {
    "max_num_batched_tokens": int,
    "max_num_seqs": int,
    "scheduler": str,
    "enable_chunked_prefill": lambda v: {"true": True, "on": True, "1": True,
                                         "false": False, "off": False, "0": False}[v.lower()],
    "scheduling_policy": str,
}
SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_KINDS = ("mean", "median", "p90", "p95", "p99")


def parse_list(name: str, text: str, kind: Callable[[str], Any]) -> list[Any]:
    """"64,128,256" -> [64, 128, 256], with an error that names the setting."""
    try:
        return [kind(v.strip()) for v in str(text).split(",") if v.strip()]
    except (ValueError, KeyError):
        raise ValueError(f"--{name.replace('_', '-')}: cannot read {text!r} as a comma-separated list") from None


def parse_rate(text: str) -> float:
    return float("inf") if text.strip().lower() in ("inf", "infinity") else float(text)


def slo_field(key: str) -> str:
    """"ttft_p99" -> "p99_ttft_ms" (the JSON field it limits)."""
    name, _, kind = key.partition("_")
    if name not in SLO_METRICS or kind not in SLO_KINDS:
        raise ValueError(f"SLO key {key!r} must be METRIC_STAT with METRIC in {', '.join(SLO_METRICS)} "
                         f"and STAT in {', '.join(SLO_KINDS)} (for example ttft_p99)")
    return f"{kind}_{name}_ms"


def parse_slo(text: str | None) -> dict[str, float]:
    """"ttft_p99=2000,tpot_p99=100" -> {"ttft_p99": 2000.0, "tpot_p99": 100.0} (milliseconds)."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--slo: {part!r} should be KEY=MILLISECONDS, e.g. ttft_p99=2000")
        slo_field(key.strip())
        try:
            slo[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {key.strip()} needs a number of milliseconds, got {value!r}") from None
    return slo


def format_points(points: list[dict[str, Any]], mark: Callable[[dict[str, Any]], str]) -> list[str]:
    """A table of configurations: throughput, p99 TTFT and TPOT, and a mark per row."""
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f}"

    width = max([13] + [len(p["label"]) for p in points]) + 2
    return [f"{'configuration':<{width}}{'out tok/s':>10}{'p99 TTFT':>10}{'p99 TPOT':>10}"] + [
        f"{p['label']:<{width}}{p['output_throughput']:>10.1f}{ms(p['p99_ttft_ms']):>10}{ms(p['p99_tpot_ms']):>10}"
        f"  {mark(p)}".rstrip() for p in points]


def meets_slo(point: dict[str, Any], slo: dict[str, float]) -> bool:
    return all(point.get(slo_field(k)) is not None and point[slo_field(k)] <= limit for k, limit in slo.items())


def best_under_slo(points: list[dict[str, Any]], slo: dict[str, float]) -> dict[str, Any] | None:
    """The highest output throughput among the points that meet every SLO limit (ties, common below
    saturation where throughput is the offered load, go to the lower p99 TTFT)."""
    ok = [p for p in points if meets_slo(p, slo)]
    return max(ok, key=lambda p: (round(p["output_throughput"], 1), -(p.get("p99_ttft_ms") or 0.0))) if ok else None


def split_grid(base: EngineConfig, values: dict[str, list[Any]]) -> tuple[EngineConfig, dict[str, list[Any]]]:
    """Settings with one value go into the base config; those with several form the grid."""
    base = engine_config(base, **{k: v[0] for k, v in values.items() if len(v) == 1})
    return base, {k: v for k, v in values.items() if len(v) > 1}


def grid_configs(base: EngineConfig, grid: dict[str, list[Any]]) -> list[EngineConfig]:
    """Every combination of the grid's values. The static baseline ignores the token budget
    and chunking, so it runs once per remaining combination."""
    names = list(grid)
    configs, seen = [], set()
    for values in itertools.product(*(grid[n] for n in names)):
        changes = dict(zip(names, values))
        if changes.get("scheduler", base.scheduler) == "static":
            changes.pop("max_num_batched_tokens", None)
            changes.pop("enable_chunked_prefill", None)
        key = tuple(sorted(changes.items()))
        if key in seen:
            continue
        seen.add(key)
        configs.append(engine_config(base, **changes))
    return configs


def run_sweep(base: EngineConfig, requests: list[WorkloadRequest], grid: dict[str, list[Any]],
              rates: list[float | None], seed: int = 0, factory: EngineFactory | None = None,
              progress: bool = True) -> tuple[list[BenchRun], list[str]]:
    """Run every configuration at every rate. Returns the runs and the configurations skipped
    as invalid (each with its reason)."""
    factory = factory or EngineFactory()
    runs, skipped = [], []
    for config in grid_configs(base, grid):
        label = ", ".join(f"{k}={getattr(config, k)}" for k in grid)
        for rate in rates:
            run_label = label + ("" if rate is None else f", rate={rate:g}")
            try:
                engine = factory.engine(config)
            except ValueError as e:
                skipped.append(f"{run_label}: {e}")
                log.warning("skipped %s: %s", run_label, e)
                break
            reqs = with_request_rate(requests, rate, seed)
            run = run_workload(engine, reqs, label=run_label, progress=progress,
                               extra={"request_rate": "inf" if rate == float("inf") else rate,
                                      **{k: getattr(config, k) for k in grid}})
            runs.append(run)
    return runs, skipped
