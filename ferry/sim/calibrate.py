"""Fit the cost model's rates to steps measured on a real engine.

The model is a sum of rooflines (see cost_model), so for a given overlap it is
linear in the unknowns 1/F, 1/B, 1/F_attn, overhead and per-request cost once it
is known which side of each max() a step is on. The fit searches a log grid for
the basin, then alternates: fix the sides, solve a least-squares problem on
relative error, re-derive the sides, until they stop changing. Each overlap in
OVERLAPS is tried and the best kept.
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


OVERLAPS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _row(t: StepTerms, sides: tuple[bool, bool, bool], ov: float) -> list[float]:
    """Coefficients of [1/F, 1/B, 1/F_attn, o, r] for a step, given which side of each max() it is on
    (True: compute-bound); the other side counts (1 - overlap)."""
    def w(on: bool) -> float:
        return 1.0 if on else 1.0 - ov

    lin_c, att_c, head_c = sides
    return [t.linear_flops * w(lin_c) + t.head_flops * w(head_c),
            t.weight_bytes * w(not lin_c) + t.kv_bytes * w(not att_c) + t.head_bytes * w(not head_c),
            t.attn_flops * w(att_c), 1.0, float(t.num_requests)]


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


def _roof(c: Any, m: Any, ov: float) -> Any:
    return np.maximum(c, m) + (1.0 - ov) * np.minimum(c, m)


def _grid_search(terms: list[StepTerms], y: np.ndarray, ov: float) -> np.ndarray:
    """Best [1/F, 1/B, 1/F_attn, o, r] over a log grid of the three rates; o and r by least squares."""
    def col(name: str) -> np.ndarray:
        return np.array([getattr(t, name) for t in terms], dtype=float)

    lf, wb, af, kv, hf, hb = (col(n) for n in ("linear_flops", "weight_bytes", "attn_flops", "kv_bytes",
                                                "head_flops", "head_bytes"))
    nreq = col("num_requests")
    inv_f = 1 / np.logspace(8, 15, 57)
    inv_b = np.append(1 / np.logspace(8, 14, 49), 0.0)  # 0: bandwidth never the limit
    f, b, fa = (g.reshape(-1, 1) for g in np.meshgrid(inv_f, inv_b, inv_f, indexing="ij"))
    roof = _roof(lf * f, wb * b, ov) + _roof(af * fa, kv * b, ov) + _roof(hf * f, hb * b, ov)  # (G, N)
    z = (y - roof) / y  # what o + r * R must explain, relative
    u, v = 1 / y, nreq / y  # o * u + r * v ~ z
    suu, suv, svv = (u * u).sum(), (u * v).sum(), (v * v).sum()
    szu, szv = z @ u, z @ v
    det = suu * svv - suv * suv
    o = np.clip((szu * svv - szv * suv) / det, 0, None)
    r = np.clip((szv * suu - szu * suv) / det, 0, None)
    err = ((z - o[:, None] * u - r[:, None] * v) ** 2).mean(axis=1)
    i = int(np.argmin(err))
    return np.array([f[i, 0], b[i, 0], fa[i, 0], o[i], r[i]])


def fit_rates(terms: list[StepTerms], seconds: list[float]) -> tuple[np.ndarray, float, float]:
    """Fit [1/F, 1/B, 1/F_attn, overhead s, per-request s] and the overlap.

    Returns them and the median relative error. For each overlap, a log-grid search finds the
    basin; alternating least squares (sides of each max() fixed, solve, re-derive the sides)
    then refines it exactly. The overlap with the lowest error wins.
    """
    y = np.asarray(seconds, dtype=float)

    def error(x: np.ndarray, ov: float) -> float:
        pred = np.array([_predict(t, x, ov) for t in terms])
        return float(np.mean(((pred - y) / y) ** 2))

    best: tuple[float, np.ndarray, float] | None = None
    for ov in OVERLAPS:
        x = _grid_search(terms, y, ov)
        sides = None
        for _ in range(50):
            if best is None or error(x, ov) < best[0]:
                best = (error(x, ov), x, ov)
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
    inv_f, inv_b, inv_fa, o, r = x
    return float(o + r * t.num_requests + _roof(t.linear_flops * inv_f, t.weight_bytes * inv_b, ov)
                 + _roof(t.attn_flops * inv_fa, t.kv_bytes * inv_b, ov)
                 + _roof(t.head_flops * inv_f, t.head_bytes * inv_b, ov))


def profile_from_fit(x: Sequence[float], overlap: float, name: str, dtype_bytes: int, memory_gb: float,
                     kv_cache_memory_gb: float | None) -> Hardware:
    """A Hardware whose rates are the fitted effective ones (efficiencies of 1)."""
    inv_f, inv_b, inv_fa, o, r = x
    inf = 1e30
    flops = 1 / inv_f if inv_f > 0 else inf
    return Hardware(name=name, peak_tflops=flops / 1e12, flops_efficiency=1.0,
                    attn_flops_efficiency=(1 / inv_fa if inv_fa > 0 else inf) / flops,
                    mem_bandwidth_gbs=(1 / inv_b if inv_b > 0 else inf) / 1e9, bw_efficiency=1.0,
                    memory_gb=memory_gb, dtype_bytes=dtype_bytes, step_overhead_ms=o * 1e3,
                    per_request_overhead_ms=r * 1e3, kv_cache_memory_gb=kv_cache_memory_gb, overlap=overlap)


def fit_profile(model: ModelConfig, samples: list[Sample], name: str, dtype_bytes: int, memory_gb: float,
                kv_cache_memory_gb: float | None = None) -> tuple[Hardware, float]:
    """Fit a profile to measured steps; returns it and the median relative error of the fit."""
    cost = CostModel(model, Hardware("unit", 1, 1, 1, dtype_bytes=dtype_bytes))
    terms = [cost.terms(s.shape, num_sampling=len(s.shape)) for s in samples]
    x, ov, err = fit_rates(terms, [s.seconds for s in samples])
    return profile_from_fit(x, ov, name, dtype_bytes, memory_gb, kv_cache_memory_gb), err


def measure_steps(executor: Any, shapes: list[Shape], reps: int = 3, passes: int = 2, seed: int = 0,
                  progress: bool = True) -> list[Sample]:
    """Time each step shape on a real executor: one pass to warm up (first touches of the KV cache
    pages cost page faults), then ``passes`` passes in shuffled order of ``reps`` timings each.
    A shape's time is the fastest of its timings: a shared machine only ever adds time, in slow
    moments that come and go, so the minimum is the machine's repeatable speed."""
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
    return [Sample(shape, min(t)) for shape, t in zip(shapes, times)]


class _TimedExecutor:
    """Wraps an executor and records how long each execute() took."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.last = 0.0

    def __getattr__(self, name: str) -> Any:  # vocab_size, tokenizer, ...: the inner executor's
        return getattr(self.inner, name)

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
