"""Offline benchmark: every request submitted at once, ignore_eos, exactly max_tokens each."""
from __future__ import annotations

import time

from ferry.bench.workload import WorkloadRequest
from ferry.core.sampling_params import SamplingParams
from ferry.engine.metrics import RunSummary, summarize
from ferry.llm import LLM


def run_offline(llm: LLM, requests: list[WorkloadRequest], use_tqdm: bool = True) -> RunSummary:
    prompts = [r.prompt_token_ids for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    llm.engine.step_stats.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm, priority=[r.priority for r in requests])
    return summarize(outs, time.perf_counter() - t0, llm.engine.step_stats)
