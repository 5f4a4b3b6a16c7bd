"""Fit the cost model's rates to steps measured on a real engine.

The model is a sum of rooflines (see cost_model), so it is linear in the unknowns
1/F, 1/B, 1/F_attn, overhead and per-request cost once it is known which side of
each max() a step is on. The fit alternates: guess the sides, solve a least-squares
problem on relative error, re-derive the sides, until they stop changing. Several
starting guesses are tried and the best kept.
"""
from __future__ import annotations

import itertools
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ferry.model.config import ModelConfig
from ferry.sim.cost_model import CostModel, StepTerms
from ferry.sim.hardware import Hardware

Shape = list[tuple[int, int]]  # (num_tokens, start) per request in one step


@dataclass
class Sample:
    shape: Shape
    seconds: float


def calibration_shapes(max_kv_tokens: int) -> list[Shape]:
    """Prefill-heavy, decode-heavy and mixed steps over several context lengths."""
    shapes: list[Shape] = []
    for b, c in itertools.product((1, 4, 16, 32, 64), (64, 512, 1536)):
        if b * (c + 1) <= max_kv_tokens:
            shapes.append([(1, c)] * b)
    for n, s in itertools.product((16, 64, 128, 256, 512, 1024), (0, 1024)):
        shapes.append([(n, s)])
    for b, n in itertools.product((8, 32), (64, 256, 480)):
        shapes.append([(1, 256)] * b + [(n, 0)])
    return shapes


def _row(t: StepTerms, sides: tuple[bool, bool, bool]) -> list[float]:
    lin_c, att_c, head_c = sides  # True: compute-bound side of that max()
    return [t.linear_flops * lin_c + t.head_flops * head_c,
            t.weight_bytes * (not lin_c) + t.kv_bytes * (not att_c) + t.head_bytes * (not head_c),
            t.attn_flops * att_c, 1.0, float(t.num_requests)]


def _sides(t: StepTerms, x: Sequence[float]) -> tuple[bool, bool, bool]:
    inv_f, inv_b, inv_fa = x[0], x[1], x[2]
    return (t.linear_flops * inv_f >= t.weight_bytes * inv_b, t.attn_flops * inv_fa >= t.kv_bytes * inv_b,
            t.head_flops * inv_f >= t.head_bytes * inv_b)


def _solve(rows: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative error with every unknown >= 0 (a negative one is dropped)."""
    w = 1.0 / y
    active = list(range(rows.shape[1]))
    while True:
        x = np.zeros(rows.shape[1])
        sol, *_ = np.linalg.lstsq(rows[:, active] * w[:, None], y * w, rcond=None)
        x[active] = sol
        neg = [i for i in active if x[i] < 0]
        if not neg:
            return x
        active.remove(min(neg, key=lambda i: x[i]))


def fit_rates(terms: list[StepTerms], seconds: list[float]) -> tuple[np.ndarray, float]:
    """Fit [1/F, 1/B, 1/F_attn, overhead s, per-request s]; returns them and the median relative error."""
    y = np.asarray(seconds, dtype=float)
    best: tuple[float, np.ndarray] | None = None
    for f, b, fa in itertools.product((1e10, 1e11, 1e12, 1e14), (1e9, 1e10, 1e11, 1e12), (1e10, 1e11, 1e12, 1e14)):
        x = np.array([1 / f, 1 / b, 1 / fa, 0.0, 0.0])
        sides = None
        for _ in range(50):
            new = [_sides(t, x) for t in terms]
            if new == sides:
                break
            sides = new
            x = _solve(np.array([_row(t, s) for t, s in zip(terms, sides)]), y)
        pred = np.array([_predict(t, x) for t in terms])
        err = float(np.mean(((pred - y) / y) ** 2))
        if best is None or err < best[0]:
            best = (err, x)
    assert best is not None
    x = best[1]
    rel = [abs(_predict(t, x) - s) / s for t, s in zip(terms, seconds)]
    return x, statistics.median(rel)


def _predict(t: StepTerms, x: Sequence[float]) -> float:
    inv_f, inv_b, inv_fa, o, r = x
    return (o + r * t.num_requests + max(t.linear_flops * inv_f, t.weight_bytes * inv_b)
            + max(t.attn_flops * inv_fa, t.kv_bytes * inv_b) + max(t.head_flops * inv_f, t.head_bytes * inv_b))


def profile_from_fit(x: Sequence[float], name: str, dtype_bytes: int, memory_gb: float,
                     kv_cache_memory_gb: float | None) -> Hardware:
    """A Hardware whose rates are the fitted effective ones (efficiencies of 1)."""
    inv_f, inv_b, inv_fa, o, r = x
    inf = 1e30
    flops = 1 / inv_f if inv_f > 0 else inf
    return Hardware(name=name, peak_tflops=flops / 1e12, flops_efficiency=1.0,
                    attn_flops_efficiency=(1 / inv_fa if inv_fa > 0 else inf) / flops,
                    mem_bandwidth_gbs=(1 / inv_b if inv_b > 0 else inf) / 1e9, bw_efficiency=1.0,
                    memory_gb=memory_gb, dtype_bytes=dtype_bytes, step_overhead_ms=o * 1e3,
                    per_request_overhead_ms=r * 1e3, kv_cache_memory_gb=kv_cache_memory_gb)


def fit_profile(model: ModelConfig, samples: list[Sample], name: str, dtype_bytes: int, memory_gb: float,
                kv_cache_memory_gb: float | None = None) -> tuple[Hardware, float]:
    """Fit a profile to measured steps; returns it and the median relative error of the fit."""
    cost = CostModel(model, Hardware("unit", 1, 1, 1, dtype_bytes=dtype_bytes))
    terms = [cost.terms(s.shape, num_sampling=len(s.shape)) for s in samples]
    x, err = fit_rates(terms, [s.seconds for s in samples])
    return profile_from_fit(x, name, dtype_bytes, memory_gb, kv_cache_memory_gb), err


def measure_steps(executor: Any, shapes: list[Shape], reps: int = 3, seed: int = 0,
                  progress: bool = True) -> list[Sample]:
    """Time each step shape on a real executor (median of ``reps`` after one warm-up)."""
    from ferry.core.kv_cache_manager import KVCacheManager
    from ferry.core.outputs import ScheduledChunk, SchedulerOutput
    from ferry.core.request import Request
    from ferry.core.sampling_params import SamplingParams

    rng = random.Random(seed)
    kv = KVCacheManager(executor.num_kv_blocks, executor.block_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    samples = []
    it = shapes
    if progress:
        from tqdm import tqdm

        it = tqdm(shapes, desc="calibration steps", unit="shape")
    for k, shape in enumerate(it):
        reqs, chunks = [], []
        for j, (n, start) in enumerate(shape):
            ids = [rng.randrange(100, executor.vocab_size) for _ in range(start + n)]
            req = Request(f"cal-{k}-{j}", ids, greedy, arrival_time=0.0)
            if kv.allocate_slots(req, start + n) is None:
                raise ValueError(f"calibration shape {k} needs more KV blocks than the executor has")
            reqs.append(req)
            chunks.append(ScheduledChunk(req, start, n, kv.block_tables[req.request_id], samples=True))
        out = SchedulerOutput(chunks=chunks)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            executor.execute(out)
            times.append(time.perf_counter() - t0)
        samples.append(Sample(shape, statistics.median(times[1:])))
        for req in reqs:
            kv.free(req)
        sampler = getattr(executor, "sampler", None)
        if sampler is not None:
            sampler.forget([r.request_id for r in reqs])
    return samples

