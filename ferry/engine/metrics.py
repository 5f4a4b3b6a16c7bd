"""Aggregate figures over finished requests."""
from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean

from ferry.engine.outputs import RequestOutput
from ferry.engine.step_stats import StepStats


@dataclass
class RunSummary:
    num_requests: int
    duration: float
    output_tokens: int
    prompt_tokens: int
    mean_ttft: float | None
    mean_tpot: float | None
    num_preemptions: int
    num_steps: int = 0
    num_padding_tokens: int = 0  # static batching: token slots spent on finished requests
    num_computed_tokens: int = 0  # every token slot computed, padding included

    @property
    def slot_utilization(self) -> float | None:
        """Useful tokens computed / token slots computed (1.0 when nothing is wasted)."""
        if not self.num_computed_tokens:
            return None
        return 1.0 - self.num_padding_tokens / self.num_computed_tokens

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration if self.duration > 0 else 0.0

    def lines(self) -> list[str]:
        def ms(x: float | None) -> str:
            return "n/a" if x is None else f"{x * 1e3:.1f} ms"

        return [
            f"requests:        {self.num_requests}",
            f"duration:        {self.duration:.2f} s",
            f"output tokens:   {self.output_tokens} ({self.output_throughput:.1f} tok/s)",
            f"prompt tokens:   {self.prompt_tokens}",
            f"mean TTFT:       {ms(self.mean_ttft)}",
            f"mean TPOT:       {ms(self.mean_tpot)}",
            f"preemptions:     {self.num_preemptions}",
        ] + ([f"steps:           {self.num_steps}",
              f"slot utilization: {self.slot_utilization:.1%} ({self.num_padding_tokens} of "
              f"{self.num_computed_tokens} token slots spent on finished requests)"]
             if self.num_computed_tokens else [])


def summarize(outputs: list[RequestOutput], duration: float, steps: list[StepStats] | None = None) -> RunSummary:
    metrics = [o.metrics for o in outputs if o.metrics is not None]
    ttfts = [m.ttft for m in metrics if m.ttft is not None]
    tpots = [m.tpot for m in metrics if m.tpot is not None]
    return RunSummary(
        num_requests=len(outputs), duration=duration,
        output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        mean_ttft=fmean(ttfts) if ttfts else None, mean_tpot=fmean(tpots) if tpots else None,
        num_preemptions=sum(m.num_preemptions for m in metrics),
        num_steps=len(steps or []),
        num_padding_tokens=sum(s.num_padding_tokens for s in steps or []),
        num_computed_tokens=sum(s.num_prefill_tokens + s.num_decode_tokens + s.num_padding_tokens
                                for s in steps or []))
