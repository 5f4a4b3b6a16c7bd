"""How far the simulator is from real runs: simulate the workload of each real run with a profile
and print the error per figure.

    .venv/bin/python benchmarks/sim_fidelity.py --hardware PROFILE.json --workload W.json RUN.json [RUN.json ...]

Each RUN.json is a ``ferry bench offline|online --output-json`` of ``W.json``; the simulation uses
the run's engine settings, request rate and seed 0 (the bench's default), so arrivals are the
same. Error = simulated / real - 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ferry.bench.runner import run_workload
from ferry.bench.workload import load_workload, with_request_rate
from ferry.config import EngineConfig
from ferry.sim.engine import SimEngineFactory
from ferry.sim.hardware import load_hardware
from ferry.sim.models import load_model_config

FIGURES = [("output tok/s", "output_throughput"), ("p50 TTFT", "median_ttft_ms"), ("p99 TTFT", "p99_ttft_ms"),
           ("p50 TPOT", "median_tpot_ms"), ("p99 TPOT", "p99_tpot_ms")]
LIMITS = {"output_throughput": 0.10, "median_ttft_ms": 0.10, "median_tpot_ms": 0.10, "p99_ttft_ms": 0.20,
          "p99_tpot_ms": 0.20}  # the targets: throughput and p50 within 10%, p99 within 20%


def compare(run_path: str, workload: str, hardware: str, model: str) -> tuple[str, dict[str, tuple[float, float]]]:
    real = json.loads(Path(run_path).read_text())
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    settings = {k: v for k, v in real["engine"].items() if k in known}
    settings.update(model=None, dtype="float32", device="auto")
    rate = real.get("request_rate", "inf")
    rate = float("inf") if rate in ("inf", None, "workload") else float(rate)
    factory = SimEngineFactory(load_model_config(model), load_hardware(hardware))
    engine = factory.engine(EngineConfig(**settings))
    sim = run_workload(engine, with_request_rate(load_workload(workload), rate, 0), progress=False).metrics.to_dict()
    label = "offline" if rate == float("inf") else f"Poisson {rate:g} req/s"
    return label, {key: (real[key], sim[key]) for _, key in FIGURES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args()
    print("| run | " + " | ".join(f"{name} real / sim" for name, _ in FIGURES) + " |")
    print("|---|" + "---|" * len(FIGURES))
    misses = 0
    for path in args.runs:
        label, figs = compare(path, args.workload, args.hardware, args.model)
        cells = []
        for _, key in FIGURES:
            r, s = figs[key]
            err = s / r - 1
            miss = abs(err) > LIMITS[key]
            misses += miss
            cells.append(f"{r:.4g} / {s:.4g} ({err:+.0%}{' !' if miss else ''})")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\n{misses} figure(s) outside the targets (marked !: throughput and p50 within 10%, p99 within 20%)")


if __name__ == "__main__":
    main()
