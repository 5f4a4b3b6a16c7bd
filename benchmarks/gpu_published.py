"""Simulate the set-ups of published vLLM measurements on GPUs and print the error per figure.

    .venv/bin/python benchmarks/gpu_published.py [--markdown]

Each case names its source (see docs/scheduling.md for the quotes) and the vLLM settings of the
measurement; the simulator runs the same workload with the same settings on the preset. The
published figure is what the source printed; "simulated" is ferry's; error = sim / published - 1.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from ferry.bench.runner import run_workload
from ferry.bench.workload import synthetic_workload
from ferry.config import EngineConfig
from ferry.sim.engine import SimEngineFactory
from ferry.sim.hardware import load_hardware
from ferry.sim.models import load_model_config

DOCS = "vllm-project/vllm docs/source/usage/torch_compile.rst (Dec 2024)"
DASH = "vLLM performance dashboard, latency tests (latency-tests.json)"
SWEEP = "johnmusgrave.com/p/vllm-throughput-latency-sweep-on (vLLM, A100 40GB)"


@dataclass
class Case:
    name: str
    source: str
    model: str
    hardware: str
    tp: int
    num_prompts: int
    input_len: int
    output_len: int
    figure: str  # "latency_s" (all submitted at once, time to finish), "output_tok_s", "tpot_ms"
    published: float
    settings: dict[str, Any] = field(default_factory=dict)


# benchmark_latency.py: one batch of `batch` prompts submitted at once, latency = time until all
# finish. vLLM V0 defaults for an 8k-context model: no chunked prefill, a budget of max_model_len.
V0 = dict(enable_chunked_prefill=False, max_num_batched_tokens=8192, max_model_len=8192, max_num_seqs=256)
CASES = [
    Case("Llama-3-8B, batch 1, 32 in / 128 out", DOCS, "llama-3.1-8b", "h100-sxm", 1, 1, 32, 128,
         "latency_s", 0.9704, V0),
    Case("Llama-3-8B, batch 1, 32 in / 128 out", DOCS, "llama-3.1-8b", "l4", 1, 1, 32, 128, "latency_s", 7.816, V0),
    Case("Llama-3-8B, batch 8, 32 in / 128 out", DASH, "llama-3.1-8b", "a100-80gb", 1, 8, 32, 128,
         "latency_s", 1.58543, V0),
    Case("Llama-3-8B, batch 8, 32 in / 128 out", DASH, "llama-3.1-8b", "h100-sxm", 1, 8, 32, 128,
         "latency_s", 0.997542, V0),
    Case("Llama-3-8B, batch 8, 32 in / 128 out", DASH, "llama-3.1-8b", "h200", 1, 8, 32, 128,
         "latency_s", 0.833421, V0),
    Case("Llama-3-70B, TP 4, batch 8, 32 in / 128 out", DASH, "llama-3.1-70b", "h100-sxm", 4, 8, 32, 128,
         "latency_s", 2.44447, V0),
    Case("Llama-3-70B, TP 4, batch 8, 32 in / 128 out", DASH, "llama-3.1-70b", "h200", 4, 8, 32, 128,
         "latency_s", 2.07753, V0),
    # benchmark_throughput.py: 1000 prompts (its default) of 256 in / 256 out, all at once.
    Case("Llama-3-8B, 1000 x 256 in / 256 out, offline", DOCS, "llama-3.1-8b", "h100-sxm", 1, 1000, 256, 256,
         "output_tok_s", 11364.08, V0),
    # vllm bench serve --max-concurrency 1, 1024 in / 128 out (V1: chunked prefill, budget 8192 by default).
    Case("Llama-3.1-8B, concurrency 1, 1024 in / 128 out", SWEEP, "llama-3.1-8b", "a100-40gb", 1, 4, 1024, 128,
         "tpot_ms", 1000 / 75, dict(max_num_seqs=1, max_num_batched_tokens=8192, max_model_len=8192)),
]


def simulate(case: Case) -> float:
    factory = SimEngineFactory(load_model_config(case.model), load_hardware(case.hardware), case.tp)
    engine = factory.engine(EngineConfig(**case.settings))
    reqs = synthetic_workload(case.num_prompts, case.input_len, case.output_len, "fixed", "fixed", seed=0,
                              vocab_size=factory.model.vocab_size)
    m = run_workload(engine, reqs, progress=False).metrics
    if case.figure == "latency_s":
        return m.duration
    if case.figure == "output_tok_s":
        return m.output_throughput
    return m.stat("tpot", "median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    rows = []
    for c in CASES:
        sim = simulate(c)
        rows.append((c, sim, sim / c.published - 1))
    if args.markdown:
        print("| set-up | GPU | figure | published | simulated | error | source |")
        print("|---|---|---|---|---|---|---|")
        for c, sim, err in rows:
            gpu = f"{c.tp} x {c.hardware}" if c.tp > 1 else c.hardware
            print(f"| {c.name} | {gpu} | {c.figure} | {c.published:.4g} | {sim:.4g} | {err:+.0%} | {c.source} |")
    else:
        for c, sim, err in rows:
            print(f"{c.name:<48} {c.tp}x{c.hardware:<10} {c.figure:<13} published {c.published:>9.4g} "
                  f"simulated {sim:>9.4g}  {err:+.1%}")


if __name__ == "__main__":
    main()
