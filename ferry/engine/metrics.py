"""Aggregate figures over finished requests."""
from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean

from ferry.engine.outputs import RequestOutput


@dataclass
class RunSummary:
    num_requests: int
    duration: float
    output_tokens: int
    prompt_tokens: int
    mean_ttft: float | None
    mean_tpot: float | None
    num_preemptions: int

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
        ]


def summarize(outputs: list[RequestOutput], duration: float) -> RunSummary:
    metrics = [o.metrics for o in outputs if o.metrics is not None]
    ttfts = [m.ttft for m in metrics if m.ttft is not None]
    tpots = [m.tpot for m in metrics if m.tpot is not None]
    return RunSummary(
        num_requests=len(outputs), duration=duration,
        output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        mean_ttft=fmean(ttfts) if ttfts else None, mean_tpot=fmean(tpots) if tpots else None,
        num_preemptions=sum(m.num_preemptions for m in metrics))
