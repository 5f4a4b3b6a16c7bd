"""Drive an engine through a workload, the way a server sees it: requests arrive on
the engine's clock while it steps. "Offline" is the special case where every
request arrives at 0. The same loop serves the real engine (wall clock) and the
simulator (a clock the executor advances)."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

from ferry.bench.workload import WorkloadRequest
from ferry.config import EngineConfig
from ferry.core.sampling_params import SamplingParams
from ferry.engine.llm_engine import LLMEngine
from ferry.engine.metrics import RunMetrics, summarize
from ferry.engine.outputs import RequestOutput
from ferry.engine.step_stats import StepStats

_RUNS = itertools.count()

# Settings that shape the loaded model and its KV cache; the rest only change scheduling.
MODEL_SETTINGS = ("model", "load_format", "dtype", "device", "gpu_memory_utilization", "quantization", "quant_activations", "fp32_matmul_precision", "kv_cache_dtype", "max_model_len", "block_size", "num_kv_blocks",
                  "kv_cache_memory_gb", "seed", "num_threads", "cache_dir")


@dataclass
class BenchRun:
    """One run: what was asked, what happened per request and per step, and the figures."""

    label: str
    config: EngineConfig
    outputs: list[RequestOutput]
    steps: list[StepStats]
    metrics: RunMetrics
    num_kv_blocks: int
    start: float  # engine clock at the start of the run; request and step times are on that clock
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the request rate

    def to_dict(self) -> dict[str, Any]:
        settings = {k: v for k, v in dataclasses.asdict(self.config).items() if k not in ("cache_dir",)}
        return {"label": self.label, **self.extra, "engine": settings, **self.metrics.to_dict()}


class EngineFactory:
    """Engines for many configurations over one loaded model: a sweep loads weights once."""

    def __init__(self) -> None:
        self._executors: dict[tuple, Any] = {}

    def engine(self, config: EngineConfig) -> LLMEngine:
        key = tuple(getattr(config, k) for k in MODEL_SETTINGS)
        executor = self._executors.get(key)
        engine = LLMEngine.from_config(config, executor)
        self._executors[key] = engine.executor
        return engine


def run_workload(engine: LLMEngine, requests: list[WorkloadRequest], label: str = "",
                 progress: bool = True, extra: dict[str, Any] | None = None,
                 temperature: float = 0.0) -> BenchRun:
    """Submit each request at its ``arrival_time`` (seconds after the start), step until all finish.

    Requests use greedy sampling (or ``temperature``, seeded by their index) with ignore_eos, so
    each yields exactly ``max_tokens``. The
    prefix cache is emptied first; requests of the run share prefixes with each other only.
    """
    clock = engine.clock
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
    prefix = f"run{next(_RUNS)}-"  # ids unique across runs on one engine
    engine.step_stats = []  # every step of the run
    engine.reset_prefix_cache()  # every run starts cold: repeated runs measure the same thing
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc=label or "requests", unit="req", dynamic_ncols=True)
    final: dict[str, RequestOutput] = {}
    t0 = clock()
    nxt = 0
    while nxt < len(order) or engine.has_unfinished():
        now = clock()
        while nxt < len(order) and t0 + requests[order[nxt]].arrival_time <= now:
            i = order[nxt]
            r = requests[i]
            engine.add_request(r.prompt_token_ids,
                               SamplingParams(temperature=temperature, seed=i if temperature else None,
                                              max_tokens=r.max_tokens, ignore_eos=True),
                               request_id=f"{prefix}{i}", arrival_time=t0 + r.arrival_time, priority=r.priority,
                               images=r.images)
            nxt += 1
        n_steps = len(engine.step_stats)
        for out in engine.step(finished_only=True):
            if out.finished:
                final[out.request_id] = out
                if bar is not None:
                    bar.update(1)
        if len(engine.step_stats) == n_steps:  # nothing could board: wait for the next arrival
            if nxt >= len(order):
                raise RuntimeError("engine has unfinished requests but schedules nothing")
            clock.sleep_until(t0 + requests[order[nxt]].arrival_time)  # type: ignore[attr-defined]
    duration = clock() - t0
    if bar is not None:
        bar.close()
    outputs = [final[f"{prefix}{i}"] for i in range(len(requests))]
    steps = list(engine.step_stats)
    return BenchRun(label=label, config=engine.config, outputs=outputs, steps=steps,
                    metrics=summarize(outputs, duration, steps, engine.num_kv_blocks),
                    num_kv_blocks=engine.num_kv_blocks, start=t0, extra=dict(extra or {}))


def engine_config(base: EngineConfig, **changes: Any) -> EngineConfig:
    """A copy of ``base`` with some settings changed (validated like any config)."""
    return dataclasses.replace(base, **changes)
