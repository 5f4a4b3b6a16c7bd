"""Where a step's time goes: by part (scheduler, packing, each projection, attention, sampling,
output processing, ...) and by step shape (decode-only by batch size, prefill by tokens).

The step's code calls ``tick(part)`` after each part; the time since the previous tick is that
part's, the Python around an operation included, so the parts add up to the whole step. Turned
off, ``tick`` is a no-op function and costs one call per part.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable

from ferry.core.outputs import SchedulerOutput
from ferry.executor.base import no_tick

__all__ = ["OVERHEAD_PARTS", "StepProfiler", "no_tick", "shape_of", "step_shape"]

# Parts outside the model's forward pass: the CPU overhead the step pays around the model.
OVERHEAD_PARTS = ("schedule", "pack", "sample", "update", "outputs")


def _bucket(n: int) -> str:
    """1, 2-3, 4-7, ...: powers of two, so a run has a handful of shapes."""
    lo = 1 << (n.bit_length() - 1)
    hi = 2 * lo - 1
    return str(lo) if lo == hi else f"{lo}-{hi}"


def step_shape(num_decodes: int, num_prefill_tokens: int) -> str:
    """'decode B=16-31', 'prefill T=512-1023' or 'mixed T=...' (T counts every token of the step)."""
    if not num_prefill_tokens:
        return f"decode B={_bucket(num_decodes)}"
    kind = "prefill" if not num_decodes else "mixed"
    return f"{kind} T={_bucket(num_decodes + num_prefill_tokens)}"


def shape_of(out: SchedulerOutput) -> str:
    """A step's shape: 'decode' exactly when it is a decode step (``SchedulerOutput.is_decode_step``);
    'encoder' for a step of image encoding alone."""
    if not out.chunks:
        return "encoder"
    rows = out.num_decode_rows
    return step_shape(rows, out.total_num_scheduled_tokens - rows)


class StepProfiler:
    """Sums of time per (step shape, part), and step counts per shape. The engine calls ``start``
    and ``finish``; the executor and its model ``tick`` and ``split`` (``ferry.executor.base.StepTimer``)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.steps: dict[str, int] = defaultdict(int)
        self._parts: dict[str, float] = defaultdict(float)
        self._last = 0.0
        self.encoder_seconds: list[float] = []  # the vision encoder's time per image (image models)
        self.encoder_cache_hits = 0

    def add_images(self, seconds: tuple[float, ...] | list[float], hits: int) -> None:
        """A step's images: the encoder's seconds per image it ran (inside the step's 'encoder' part),
        and the images whose output it already held."""
        self.encoder_seconds.extend(seconds)
        self.encoder_cache_hits += hits

    def encoder_summary(self) -> dict[str, Any] | None:
        """Images encoded, ms per image (mean, median, max) and cache hits; None without images."""
        s = sorted(self.encoder_seconds)
        if not s and not self.encoder_cache_hits:
            return None
        ms = [1e3 * t for t in s]
        return {"images": len(s), "cache_hits": self.encoder_cache_hits,
                "ms_per_image": {"mean": sum(ms) / len(ms), "median": ms[len(ms) // 2], "max": ms[-1]} if ms else None}

    def start(self) -> None:
        self._parts = defaultdict(float)
        self._last = self.clock()

    def tick(self, part: str) -> None:
        now = self.clock()
        self._parts[part] += now - self._last
        self._last = now

    def split(self, parts: dict[str, float], rest: str) -> None:
        """A tick for a stretch timed by its own code (a fused C kernel): ``parts`` seconds go
        to their parts, the remainder of the stretch to ``rest``."""
        now = self.clock()
        for part, t in parts.items():
            self._parts[part] += t
        self._parts[rest] += max(0.0, now - self._last - sum(parts.values()))
        self._last = now

    def finish(self, shape: str) -> None:
        total = self.totals[shape]
        for part, t in self._parts.items():
            total[part] += t
        self.steps[shape] += 1

    def reset(self) -> None:
        self.totals.clear()
        self.steps.clear()
        self.encoder_seconds.clear()
        self.encoder_cache_hits = 0

    def to_dict(self) -> dict[str, Any]:
        """Per shape: steps, mean step ms, and per part mean ms and share of the step."""
        out: dict[str, Any] = {}
        for shape in sorted(self.totals, key=_shape_order):
            n, parts = self.steps[shape], self.totals[shape]
            step = sum(parts.values())
            out[shape] = {
                "steps": n, "step_ms": 1e3 * step / n,
                "overhead_share": sum(parts.get(p, 0.0) for p in OVERHEAD_PARTS) / step if step else 0.0,
                "parts": {p: {"ms": 1e3 * t / n, "share": t / step if step else 0.0}
                          for p, t in sorted(parts.items(), key=lambda kv: -kv[1])},
            }
        return out

    def table(self) -> str:
        """One block per step shape, parts from the most costly down."""
        lines = []
        for shape, s in self.to_dict().items():
            lines.append(f"{shape}: {s['steps']} steps, {s['step_ms']:.2f} ms per step, "
                         f"CPU overhead ({'+'.join(OVERHEAD_PARTS)}) {100 * s['overhead_share']:.1f}%")
            for part, v in s["parts"].items():
                lines.append(f"  {part:<10} {v['ms']:8.3f} ms  {100 * v['share']:5.1f}%")
        enc = self.encoder_summary()
        if enc is not None:
            per = enc["ms_per_image"]
            lines.append(f"vision encoder: {enc['images']} images encoded" + (
                f", {per['mean']:.1f} ms per image (median {per['median']:.1f}, max {per['max']:.1f})" if per else "")
                + f", {enc['cache_hits']} encoder cache hits")
        return "\n".join(lines)


def _shape_order(shape: str) -> tuple[str, int]:
    kind, _, size = shape.partition(" ")
    return kind, int(size.split("=")[1].split("-")[0]) if "=" in size else 0
