"""Run metrics: per-request latencies and per-step counters folded into one table.

Field names follow the usual serving-benchmark names (completed, request_throughput,
mean_/median_/p90_/p95_/p99_ ttft_ms, ...), so ferry's JSON reads like vLLM's.
Aborted and failed requests are counted (num_aborted, num_failed) but left out of
``completed``, of the throughputs and of every latency figure. Their computed
tokens still count in the step counters: that work was done.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

import numpy as np

from ferry.engine.outputs import RequestOutput
from ferry.engine.step_stats import StepStats

LATENCIES = ("ttft", "tpot", "itl", "e2el", "queue")
PERCENTILES = (90, 95, 99)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default, as serving benchmarks use); None if empty."""
    return float(np.percentile(values, q)) if values else None


@dataclass
class RunMetrics:
    """What one run measured. Latency samples are kept in seconds; the table is in ms."""

    completed: int
    num_aborted: int
    num_failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    num_preemptions: int
    num_steps: int = 0
    num_computed_tokens: int = 0  # every token slot computed, padding and recompute included
    num_padding_tokens: int = 0  # static batching: idle slot-steps spent on finished requests
    num_recomputed_tokens: int = 0  # computed again after a preemption dropped them
    num_cached_tokens: int = 0  # prompt tokens of completed requests found in the prefix cache
    num_drafts: int = 0  # speculative verify chunks
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_kv_usage: float | None = None  # fraction of KV blocks in use, averaged over steps
    max_kv_usage: float | None = None
    samples: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration if self.duration > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.total_output_tokens / self.duration if self.duration > 0 else 0.0

    @property
    def total_token_throughput(self) -> float:
        return (self.total_input_tokens + self.total_output_tokens) / self.duration if self.duration > 0 else 0.0

    @property
    def slot_utilization(self) -> float | None:
        """Useful tokens computed / token slots computed; padding and recompute are not useful."""
        if not self.num_computed_tokens:
            return None
        wasted = self.num_padding_tokens + self.num_recomputed_tokens
        return 1.0 - wasted / self.num_computed_tokens

    @property
    def generation_slot_utilization(self) -> float | None:
        """Output tokens / (output tokens + idle slot-steps): how the batching literature
        measures a static batch's waste.

        A static batch of n requests held for max(L) steps wastes 1 - sum(L) / (n * max(L)).
        """
        total = self.total_output_tokens + self.num_padding_tokens
        return self.total_output_tokens / total if total else None

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens taken from the prefix cache / prompt tokens (completed requests)."""
        return self.num_cached_tokens / self.total_input_tokens if self.total_input_tokens else None

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None without drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens a verify step yields on average: 1 + accepted drafts per verify (vLLM's mean
        acceptance length); None without drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def stat(self, name: str, kind: str) -> float | None:
        """``kind`` is mean, median, max or pNN; ``name`` one of LATENCIES. Seconds."""
        values = self.samples.get(name, [])
        if not values:
            return None
        if kind == "mean":
            return fmean(values)
        if kind == "max":
            return max(values)
        return percentile(values, 50 if kind == "median" else float(kind[1:]))

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-ready figures with the serving-benchmark names (latencies in ms)."""
        d: dict[str, Any] = {
            "completed": self.completed, "num_aborted": self.num_aborted, "num_failed": self.num_failed,
            "duration": self.duration, "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput, "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for name in LATENCIES:
            key = "queue_time" if name == "queue" else name
            for kind in ("mean", "median", *(f"p{q}" for q in PERCENTILES)):
                v = self.stat(name, kind)
                d[f"{kind}_{key}_ms"] = None if v is None else v * 1e3
        itl_max = self.stat("itl", "max")
        d["max_itl_ms"] = None if itl_max is None else itl_max * 1e3
        d.update(num_preemptions=self.num_preemptions, slot_utilization=self.slot_utilization,
                 generation_slot_utilization=self.generation_slot_utilization, num_steps=self.num_steps,
                 num_computed_tokens=self.num_computed_tokens, num_padding_tokens=self.num_padding_tokens,
                 num_recomputed_tokens=self.num_recomputed_tokens, mean_kv_usage=self.mean_kv_usage,
                 max_kv_usage=self.max_kv_usage, num_cached_tokens=self.num_cached_tokens,
                 prefix_cache_hit_rate=self.prefix_cache_hit_rate, num_drafts=self.num_drafts,
                 num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted_tokens,
                 spec_acceptance_rate=self.spec_acceptance_rate,
                 spec_mean_accepted_length=self.spec_mean_accepted_length)
        return d

    def lines(self) -> list[str]:
        """A human-readable table."""
        def ms(v: float | None) -> str:
            return "n/a" if v is None else f"{v * 1e3:.1f}"

        def pct(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.1%}"

        out = [
            f"{'completed':<28}{self.completed}" + (f" ({self.num_aborted} aborted, {self.num_failed} failed)"
                                                     if self.num_aborted or self.num_failed else ""),
            f"{'duration':<28}{self.duration:.2f} s",
            f"{'input / output tokens':<28}{self.total_input_tokens} / {self.total_output_tokens}",
            f"{'request throughput':<28}{self.request_throughput:.2f} req/s",
            f"{'output throughput':<28}{self.output_throughput:.1f} tok/s",
            f"{'total token throughput':<28}{self.total_token_throughput:.1f} tok/s",
            f"{'(ms)':<12}{'mean':>9}{'median':>9}{'p90':>9}{'p95':>9}{'p99':>9}{'max':>9}",
        ]
        for name in LATENCIES:
            out.append(f"{name.upper():<12}" + "".join(
                f"{ms(self.stat(name, k)):>9}" for k in ("mean", "median", "p90", "p95", "p99", "max")))
        out += [
            f"{'preemptions':<28}{self.num_preemptions}",
            f"{'steps':<28}{self.num_steps}",
            f"{'slot utilization':<28}{pct(self.slot_utilization)} ({self.num_padding_tokens} idle + "
            f"{self.num_recomputed_tokens} recomputed of {self.num_computed_tokens} token slots)",
            f"{'generation slot util.':<28}{pct(self.generation_slot_utilization)}",
            f"{'KV usage mean / max':<28}{pct(self.mean_kv_usage)} / {pct(self.max_kv_usage)}",
            f"{'prefix cache hit rate':<28}{pct(self.prefix_cache_hit_rate)} ({self.num_cached_tokens} of "
            f"{self.total_input_tokens} prompt tokens)",
        ]
        if self.num_drafts:
            out.append(f"{'spec. decoding':<28}{pct(self.spec_acceptance_rate)} of {self.num_draft_tokens} drafts "
                       f"accepted, {self.spec_mean_accepted_length:.2f} tokens per verify")
        return out


def summarize(outputs: list[RequestOutput], duration: float, steps: list[StepStats] | None = None,
              num_kv_blocks: int | None = None) -> RunMetrics:
    """Fold finished requests and the steps that served them into one RunMetrics."""
    steps = steps or []
    done = [o for o in outputs if o.outputs and o.outputs[0].finish_reason not in ("abort", "error")]
    metrics = [o.metrics for o in done if o.metrics is not None]
    samples: dict[str, list[float]] = {name: [] for name in LATENCIES}
    for m in metrics:
        for name, v in (("ttft", m.ttft), ("tpot", m.tpot), ("e2el", m.e2e), ("queue", m.queue_time)):
            if v is not None:
                samples[name].append(v)
        samples["itl"].extend(m.itls)
    usage = [s.num_kv_blocks_used / num_kv_blocks for s in steps] if num_kv_blocks else []
    every = [o.metrics for o in outputs if o.metrics is not None]
    return RunMetrics(
        completed=len(done),
        num_aborted=sum(1 for o in outputs if o.outputs and o.outputs[0].finish_reason == "abort"),
        num_failed=sum(1 for o in outputs if o.outputs and o.outputs[0].finish_reason == "error"),
        duration=duration,
        total_input_tokens=sum(len(o.prompt_token_ids) for o in done),
        total_output_tokens=sum(len(c.token_ids) for o in done for c in o.outputs),
        num_preemptions=sum(m.num_preemptions for m in every),
        num_steps=len(steps),
        num_computed_tokens=sum(s.num_tokens for s in steps),
        num_padding_tokens=sum(s.num_padding_tokens for s in steps),
        num_recomputed_tokens=sum(m.num_recomputed_tokens for m in every),
        num_cached_tokens=sum(m.num_cached_tokens for m in metrics),
        num_drafts=sum(s.num_drafts for s in steps), num_draft_tokens=sum(s.num_draft_tokens for s in steps),
        num_accepted_tokens=sum(s.num_accepted_tokens for s in steps),
        mean_kv_usage=fmean(usage) if usage else None, max_kv_usage=max(usage) if usage else None,
        samples=samples)
