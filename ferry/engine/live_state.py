"""What the scheduler is doing right now, for the live dashboard (``GET /dashboard/state``).

Fed after every step from the engine thread, under the engine lock (a step observer the server
attaches, as it does ``ServerMetrics``), from the step's record and the scheduler's state. It
keeps a bounded history only, so a server can run for ever. It has a small lock of its own, so a
snapshot never has to wait for a step: a cold prefill step can take seconds, and the dashboard
should go on answering meanwhile. Pure Python: the server imports it without torch.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ferry.engine.metrics import percentile
from ferry.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from ferry.engine.llm_engine import LLMEngine

STEPS_KEPT = 240
WINDOW_S = 60.0
# Bounds memory (and the cost of a snapshot's sort) under a flood of short requests; a window
# that saw more than this many finishes reports its latest ones.
FINISHED_KEPT = 20_000
QUANTILES = (50, 90, 99)


@dataclass
class _Finished:
    at: float  # monotonic seconds
    ttft: float | None
    tpot: float | None


class LiveState:
    """A bounded recent history of one engine's steps and finished requests.

    ``on_step`` is called after each step; ``snapshot`` returns a JSON-able dict (the fields are
    documented in README.md, "Live dashboard"). Times in the snapshot are epoch seconds; the
    sliding window itself runs on ``time.monotonic`` so that a wall-clock jump cannot empty or
    stretch it.
    """

    def __init__(self, window_s: float = WINDOW_S, steps_kept: int = STEPS_KEPT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.started = clock()
        # Epoch = monotonic + offset, fixed once: step times stay ordered whatever the wall clock does.
        self._epoch_offset = time.time() - self.started
        self._mutex = threading.Lock()  # on_step (engine thread) against snapshot (a worker thread)
        self.steps: deque[dict[str, Any]] = deque(maxlen=steps_kept)
        self.num_steps = 0
        self.num_output_tokens = 0
        self.num_finished = 0
        self._now: dict[str, Any] = {"running": 0, "waiting": 0, "preemptions": 0, "kv_blocks_used": 0,
                                     "kv_blocks_total": 0, "kv_usage": 0.0, "t": None}
        self._budget: int | None = None
        self._finished: deque[_Finished] = deque(maxlen=FINISHED_KEPT)
        self._tokens: deque[tuple[float, int]] = deque()  # (monotonic time, output tokens of one step)
        self._lookups: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens looked up, hits)

    def epoch(self, t: float) -> float:
        """Epoch seconds of monotonic time ``t`` (of ``clock``)."""
        return round(t + self._epoch_offset, 3)

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Record the step that just ran (``engine.last_step``) and the requests it finished.
        Call with the engine lock held."""
        now = self.clock()
        stats = engine.last_step
        tokens, finished = 0, []
        for out in outputs:
            comp = out.outputs[0] if out.outputs else None
            if comp is None or comp.finish_reason == "error":
                continue
            tokens += out.num_new_tokens
            if out.finished and out.metrics is not None:
                finished.append(_Finished(now, out.metrics.ttft, out.metrics.tpot))
        with self._mutex:
            self._read_now(engine, now)
            if stats is not None:  # None: the step scheduled nothing
                self.num_steps += 1
                n = self._now
                self.steps.append({
                    "t": self.epoch(now), "duration": round(stats.duration, 5),
                    "prefill": stats.num_prefill_tokens, "decode": stats.num_decode_tokens,
                    "padding": stats.num_padding_tokens, "budget": self._budget,
                    "requests": stats.num_requests, "preempted": stats.num_preempted,
                    "running": n["running"], "waiting": n["waiting"], "kv_used": n["kv_blocks_used"]})
            self.num_finished += len(finished)
            self._finished.extend(finished)
            if tokens:
                self.num_output_tokens += tokens
                self._tokens.append((now, tokens))
            if stats is not None and stats.num_prefix_queried_tokens:
                self._lookups.append((now, stats.num_prefix_queried_tokens, stats.num_prefix_hit_tokens))
            self._expire(now)

    def on_abort(self, n: int) -> None:
        """Aborts leave no trace here: their freed blocks show at the next ``refresh``."""

    def refresh(self, engine: LLMEngine) -> None:
        """Re-read the current counts (requests come and go, and aborts free blocks, between
        steps). Call with the engine lock held."""
        with self._mutex:
            self._read_now(engine, self.clock())

    def _read_now(self, engine: LLMEngine, now: float) -> None:
        state = engine.scheduler.state()
        self._budget = engine.config.max_num_batched_tokens
        self._now = {"running": state.num_running, "waiting": state.num_waiting,
                     "preemptions": state.num_preemptions, "kv_blocks_used": state.num_kv_blocks_used,
                     "kv_blocks_total": state.num_kv_blocks, "kv_usage": state.kv_usage, "t": self.epoch(now)}

    def _expire(self, now: float) -> None:
        edge = now - self.window_s
        for q in (self._finished, self._tokens, self._lookups):
            while q and _time_of(q[0]) < edge:
                q.popleft()

    def snapshot(self, engine: LLMEngine | None = None) -> dict[str, Any]:
        """The state as plain JSON types. With ``engine`` (whose lock the caller holds) the
        current counts are read first; without it they are those the last step left."""
        if engine is not None:
            self.refresh(engine)
        with self._mutex:  # copied under the lock, sorted outside it
            now = self.clock()
            self._expire(now)
            steps, now_counts = list(self.steps), dict(self._now)
            finished, tokens = list(self._finished), sum(n for _, n in self._tokens)
            queried, hits = sum(q for _, q, _ in self._lookups), sum(h for _, _, h in self._lookups)
            counts = {"budget": self._budget, "num_steps": self.num_steps,
                      "num_output_tokens": self.num_output_tokens, "num_finished": self.num_finished}
        # A server up for 5 s has seen 5 s of tokens, not 60.
        span = min(self.window_s, max(now - self.started, 1e-9))

        def quantiles(values: list[float]) -> dict[str, float | None]:
            return {f"p{q}": percentile(values, q) for q in QUANTILES}

        return {
            "time": self.epoch(now), **counts, "steps": steps, "now": now_counts,
            "window": {
                "seconds": self.window_s, "span": round(span, 3),
                "finished": len(finished), "output_tokens": tokens, "output_tokens_per_s": tokens / span,
                "prefix_cache_queries": queried, "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": hits / queried if queried else None,
                "ttft": quantiles([f.ttft for f in finished if f.ttft is not None]),
                "tpot": quantiles([f.tpot for f in finished if f.tpot is not None]),
            },
        }


def _time_of(item: _Finished | tuple) -> float:
    return item.at if isinstance(item, _Finished) else item[0]
