"""Fit the cost model's rates to steps measured on a real engine.

Steps come from ordinary benchmark runs (``ferry bench ... --output-json``: every step's
composition and wall time, ``fit_from_runs``) or from timing synthetic step shapes on the
executor (``measure_steps``). The model is a sum of rooflines (see cost_model), so for a given
overlap it is linear in the unknowns 1/F, 1/B, 1/F_attn, 1/G and the fixed costs (per step, per
request, per prefill chunk)
once it is known which side of each max() a step is on. The fit searches a log grid for the
basin, then alternates: fix the sides, solve a robust (Huber) least-squares problem on relative
error, re-derive the sides, until they stop changing. Each overlap in OVERLAPS is tried and the
best kept. Huber, not plain least squares and not the fastest timing: on a shared machine
some steps are slowed by other tenants, and those outliers must not pull the rates.
"""
from __future__ import annotations

import itertools
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ferry.executor.base import WrappedExecutor
from ferry.model.config import ModelConfig
from ferry.sim.cost_model import CostModel, StepTerms
from ferry.sim.hardware import Hardware

Shape = list[tuple[int, int]]  # (num_tokens, start) per request in one step


@dataclass
class Sample:
    shape: Shape
    seconds: float
    rows: int | None = None  # LM-head rows; None: one per chunk


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


OVERLAPS = (0.0, 0.25, 0.5, 0.75, 1.0)
HUBER = 1.345  # in robust standard deviations of the relative residuals: 95% efficiency on clean data


def _row(t: StepTerms, sides: tuple[bool, bool, bool], ov: float) -> list[float]:
    """Coefficients of [1/F, 1/B, 1/F_attn, 1/G, o, r, p] for a step, given which side of each max()
    it is on (True: compute-bound); the other side counts (1 - overlap)."""
    def w(on: bool) -> float:
        return 1.0 if on else 1.0 - ov

    lin_c, att_c, head_c = sides
    return [t.linear_flops * w(lin_c) + t.head_flops * w(head_c),
            t.weight_bytes * w(not lin_c) + t.kv_bytes * w(not att_c) + t.head_bytes * w(not head_c),
            t.attn_flops * w(att_c), t.gather_bytes, 1.0, float(t.num_requests), float(t.num_prefill_chunks)]


def _sides(t: StepTerms, x: Sequence[float]) -> tuple[bool, bool, bool]:
    inv_f, inv_b, inv_fa = x[0], x[1], x[2]
    return (t.linear_flops * inv_f >= t.weight_bytes * inv_b, t.attn_flops * inv_fa >= t.kv_bytes * inv_b,
            t.head_flops * inv_f >= t.head_bytes * inv_b)


def _huber_weights(r: np.ndarray) -> np.ndarray:
    scale = 1.4826 * float(np.median(np.abs(r - np.median(r)))) or 1e-3
    a = np.abs(r) / (HUBER * scale)
    return np.where(a <= 1, 1.0, 1.0 / np.maximum(a, 1e-12))


def _solve(rows: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Huber regression on relative error (iteratively reweighted least squares) with every
    unknown >= 0 (a negative one is dropped)."""
    w = 1.0 / y
    active = list(range(rows.shape[1]))
    while True:
        x = np.zeros(rows.shape[1])
        hw = np.ones_like(y)
        for _ in range(20):
            sw = np.sqrt(hw) * w
            sol, *_ = np.linalg.lstsq(rows[:, active] * sw[:, None], y * sw, rcond=None)
            x[active] = sol
            new = _huber_weights((rows @ x - y) / y)
            if np.allclose(new, hw, atol=1e-4):
                break
            hw = new
        neg = [i for i in active if x[i] < 0]
        if not neg:
            return x
        active.remove(min(neg, key=lambda i: x[i]))


def _loss(rel: np.ndarray) -> float:
    """Mean Huber loss of relative residuals (quadratic within 5%, linear beyond)."""
    a = np.abs(rel)
    d = 0.05
    return float(np.mean(np.where(a <= d, 0.5 * a * a, d * (a - 0.5 * d))))


def _roof(c: Any, m: Any, ov: float) -> Any:
    return np.maximum(c, m) + (1.0 - ov) * np.minimum(c, m)


def _grid_search(terms: list[StepTerms], y: np.ndarray, ov: float) -> np.ndarray:
    """Best [1/F, 1/B, 1/F_attn, 1/G, o, r, p] over a log grid of the three rates; the linear rest by
    least squares (the same 4 columns for every grid point, so one pseudo-inverse serves all)."""
    def col(name: str) -> np.ndarray:
        return np.array([getattr(t, name) for t in terms], dtype=float)

    lf, wb, af, kv, hf, hb, gb = (col(n) for n in ("linear_flops", "weight_bytes", "attn_flops", "kv_bytes",
                                                    "head_flops", "head_bytes", "gather_bytes"))
    nreq, npre = col("num_requests"), col("num_prefill_chunks")
    inv_f = 1 / np.logspace(8, 15, 57)
    inv_b = np.append(1 / np.logspace(8, 14, 49), 0.0)  # 0: bandwidth never the limit
    f, b, fa = (g.reshape(-1, 1) for g in np.meshgrid(inv_f, inv_b, inv_f, indexing="ij"))
    roof = _roof(lf * f, wb * b, ov) + _roof(af * fa, kv * b, ov) + _roof(hf * f, hb * b, ov)  # (G, N)
    z = (y - roof) / y  # what g * gather + o + r * R + p * R_prefill must explain, relative
    m = np.stack([gb / y, 1 / y, nreq / y, npre / y], axis=1)  # (N, 4)
    coef = np.clip(z @ np.linalg.pinv(m).T, 0, None)  # (G, 4)
    err = ((z - coef @ m.T) ** 2).mean(axis=1)
    i = int(np.argmin(err))
    return np.array([f[i, 0], b[i, 0], fa[i, 0], *coef[i]])


def fit_rates(terms: list[StepTerms], seconds: list[float], seed: int = 0) -> tuple[np.ndarray, float, float]:
    """Fit [1/F, 1/B, 1/F_attn, 1/G, overhead s, per-request s, per-prefill-chunk s] and the overlap.

    Returns them and the median relative error. For each overlap, a log-grid search (on at most
    400 of the steps) finds the basin; alternating robust least squares (sides of each max()
    fixed, solve, re-derive the sides) then refines it on every step. The overlap with the
    lowest robust loss wins.
    """
    y = np.asarray(seconds, dtype=float)
    pick = sorted(random.Random(seed).sample(range(len(terms)), min(400, len(terms))))

    def loss(x: np.ndarray, ov: float) -> float:
        pred = np.array([_predict(t, x, ov) for t in terms])
        return _loss((pred - y) / y)

    best: tuple[float, np.ndarray, float] | None = None
    for ov in OVERLAPS:
        x = _grid_search([terms[i] for i in pick], y[pick], ov)
        sides = None
        for _ in range(50):
            e = loss(x, ov)
            if best is None or e < best[0]:
                best = (e, x, ov)
            new = [_sides(t, x) for t in terms]
            if new == sides:
                break
            sides = new
            x = _solve(np.array([_row(t, s, ov) for t, s in zip(terms, sides)]), y)
    assert best is not None
    _, x, ov = best
    rel = [abs(_predict(t, x, ov) - s) / s for t, s in zip(terms, seconds)]
    return x, ov, statistics.median(rel)


def _predict(t: StepTerms, x: Sequence[float], ov: float) -> float:
    inv_f, inv_b, inv_fa, inv_g, o, r, p = x
    return float(o + r * t.num_requests + p * t.num_prefill_chunks + _roof(t.linear_flops * inv_f, t.weight_bytes * inv_b, ov)
                 + _roof(t.attn_flops * inv_fa, t.kv_bytes * inv_b, ov)
                 + _roof(t.head_flops * inv_f, t.head_bytes * inv_b, ov) + t.gather_bytes * inv_g)


def profile_from_fit(x: Sequence[float], overlap: float, name: str, dtype_bytes: int, memory_gb: float,
                     kv_cache_memory_gb: float | None) -> Hardware:
    """A Hardware whose rates are the fitted effective ones (efficiencies of 1)."""
    inv_f, inv_b, inv_fa, inv_g, o, r, p = x
    inf = 1e30
    flops = 1 / inv_f if inv_f > 0 else inf
    return Hardware(name=name, peak_tflops=flops / 1e12, flops_efficiency=1.0,
                    attn_flops_efficiency=(1 / inv_fa if inv_fa > 0 else inf) / flops,
                    mem_bandwidth_gbs=(1 / inv_b if inv_b > 0 else inf) / 1e9, bw_efficiency=1.0,
                    memory_gb=memory_gb, dtype_bytes=dtype_bytes, step_overhead_ms=o * 1e3,
                    per_request_overhead_ms=r * 1e3, per_prefill_chunk_ms=p * 1e3, kv_cache_memory_gb=kv_cache_memory_gb, overlap=overlap,
                    context_gather_gbs=1 / inv_g / 1e9 if inv_g > 0 else 0.0)


def fit_profile(model: ModelConfig, samples: list[Sample], name: str, dtype_bytes: int, memory_gb: float,
                kv_cache_memory_gb: float | None = None) -> tuple[Hardware, float]:
    """Fit a profile to measured steps; returns it and the median relative error of the fit."""
    cost = CostModel(model, Hardware("unit", 1, 1, 1, dtype_bytes=dtype_bytes))
    terms = [cost.terms(s.shape, num_sampling=len(s.shape) if s.rows is None else s.rows) for s in samples]
    x, ov, err = fit_rates(terms, [s.seconds for s in samples])
    return profile_from_fit(x, ov, name, dtype_bytes, memory_gb, kv_cache_memory_gb), err


def samples_from_runs(paths: Sequence[str | Path]) -> tuple[list[Sample], dict[str, Any]]:
    """The steps of benchmark runs (``ferry bench offline|online --output-json``) as samples, and
    the engine settings of the first run (the runs must share model, dtype and KV size)."""
    samples: list[Sample] = []
    settings: dict[str, Any] | None = None
    for path in paths:
        data = json.loads(Path(path).read_text())
        if "steps" not in data or "engine" not in data:
            raise ValueError(f"{path}: no step records; write one with ferry bench offline|online --output-json")
        engine = {k: data["engine"].get(k) for k in ("model", "dtype", "quantization", "kv_cache_memory_gb",
                                                      "num_kv_blocks", "fp32_matmul_precision")}
        if settings is None:
            settings = engine
        elif engine != settings:
            raise ValueError(f"{path}: engine settings {engine} differ from the first run's {settings}: "
                             f"a profile describes one model, dtype and KV size")
        samples += [Sample([tuple(c) for c in r["chunks"]], r["wall"], r["rows"]) for r in data["steps"]
                    if r["wall"] > 0]
    if not samples or settings is None:
        raise ValueError("no steps to fit: give at least one run with steps")
    return samples, settings


def measure_steps(executor: Any, shapes: list[Shape], reps: int = 3, passes: int = 2, seed: int = 0,
                  progress: bool = True) -> list[Sample]:
    """Time each step shape on a real executor: one pass to warm up (first touches of the KV cache
    pages cost page faults), then ``passes`` passes in shuffled order of ``reps`` timings each.
    A shape's time is the median of its timings. (The fastest was tried: on a shared machine it
    is systematically optimistic, and simulations from it ran 20% fast.)"""
    from ferry.core.kv_cache_manager import KVCacheManager
    from ferry.core.outputs import NewRequest, ScheduledChunk, SchedulerOutput
    from ferry.core.request import Request
    from ferry.core.sampling_params import SamplingParams

    rng = random.Random(seed)
    kv = KVCacheManager(executor.num_kv_blocks, executor.block_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times: list[list[float]] = [[] for _ in shapes]
    order = [list(range(len(shapes)))] + [rng.sample(range(len(shapes)), len(shapes)) for _ in range(passes)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(shapes) * (passes + 1), desc="calibration steps", unit="step")
    done: list[str] = []  # the executor drops these requests' state with the next step
    for p, pass_order in enumerate(order):
        for k in pass_order:
            reqs, chunks = [], []
            for j, (n, start) in enumerate(shapes[k]):
                ids = [rng.randrange(100, executor.vocab_size) for _ in range(start + n)]
                req = Request(f"cal-{p}-{k}-{j}", ids, greedy, arrival_time=0.0)
                if kv.allocate_slots(req, start + n) is None:
                    raise ValueError(f"calibration shape {k} needs more KV blocks than the executor has")
                reqs.append(req)
                # n tokens after ``start`` in the cache (their KV is whatever the slots hold: only the time counts).
                chunks.append(ScheduledChunk(req.request_id, start, n, kv.block_tables[req.request_id], samples=True))
            out = SchedulerOutput(chunks=chunks, finished_req_ids=done,
                                  new_requests=[NewRequest(r.request_id, r.prompt_token_ids, greedy) for r in reqs])
            for _ in range(reps if p else 1):  # the same step again: its bookkeeping is applied once
                t0 = time.perf_counter()
                executor.execute(out)
                if p:
                    times[k].append(time.perf_counter() - t0)
            for req in reqs:
                kv.free(req)
            done = [r.request_id for r in reqs]
            if bar is not None:
                bar.update(1)
    states = getattr(executor, "states", None)
    if states is not None:
        states.apply(SchedulerOutput(finished_req_ids=done))
    if bar is not None:
        bar.close()
    return [Sample(shape, statistics.median(t)) for shape, t in zip(shapes, times)]


class _TimedExecutor(WrappedExecutor):
    """Wraps an executor and records how long each execute() took."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.last = 0.0

    def execute(self, out: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner.execute(out)
        finally:
            self.last = time.perf_counter() - t0


def measure_engine_overhead(executor: Any, config: Any, num_requests: int = 48, seed: int = 0) -> tuple[float, float]:
    """Seconds the engine spends around the executor per step (scheduling, stop checks,
    detokenizing, outputs): fitted as ``a + b x requests in the step`` on a short real run."""
    from ferry.core.sampling_params import SamplingParams
    from ferry.engine.llm_engine import LLMEngine

    timed = _TimedExecutor(executor)
    engine = LLMEngine.from_config(config, timed)
    rng = random.Random(seed)
    for i in range(num_requests):
        ids = [rng.randrange(100, executor.vocab_size) for _ in range(rng.randint(16, 96))]
        engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 48), ignore_eos=True))
    rows, ys = [], []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step(finished_only=True)
        total = time.perf_counter() - t0
        rows.append([1.0, float(engine.step_stats[-1].num_requests)])
        ys.append(max(0.0, total - timed.last))
    (a, b), *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    return max(0.0, float(a)), max(0.0, float(b))
