"""Measure ``speculative_config.step_cost`` (adaptive_k's cost model) for a target and its draft.

``target(rows)``: plain decode steps of n requests; ``draft(n)`` and ``verify(n)``: from verify
steps of k = 1 and k = 4 drafts over n requests (step time = target(n (k + 1)) + k draft(n) +
verify(n), solved for the two unknowns). The engine's whole step wall time, medians, in units of
the one-row target step. Prints the JSON to pass as ``step_cost``.

    python benchmarks/spec_step_cost.py --model target.gguf --draft draft.gguf --quantization none --dtype float32
"""
from __future__ import annotations

import argparse
import json
import statistics

from ferry import LLM, SamplingParams
from ferry.core.spec_k import _at

TARGET_ROWS = (1, 2, 4, 5, 8, 16, 20, 32, 64, 80, 128, 192, 256, 320)
DRAFT_REQUESTS = (1, 4, 16, 64)


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 20000 + 100 for i in range(32)] for j in range(n)]


def _step(llm: LLM, n: int, k: int) -> float:
    """Median wall time of the steps where all ``n`` requests decode with ``k`` drafts each (the
    second of two runs: the first warms up)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for _ in range(2):
        llm.engine.step_stats = []
        llm.generate(_prompts(n), params, use_tqdm=False)
    walls = [s.wall for s in llm.engine.step_stats
             if s.num_prefill_tokens == 0 and s.num_requests == n and s.num_draft_tokens == n * k]
    if not walls:
        raise RuntimeError(f"no step of {n} requests with {k} drafts each was seen")
    return statistics.median(walls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--quantization", default=None)
    p.add_argument("--dtype", default="auto")
    a = p.parse_args()
    common = dict(model=a.model, quantization=a.quantization, dtype=a.dtype, max_num_seqs=max(TARGET_ROWS),
                  kv_cache_memory_gb=1.0)
    plain = LLM(**common)
    target = {n: _step(plain, n, 0) for n in TARGET_ROWS}
    del plain
    unit = target[1]
    curve = tuple((n, t / unit) for n, t in target.items())
    spec = {}
    for k in (1, 4):
        llm = LLM(**common, speculative_config={"model": a.draft, "num_speculative_tokens": k})
        spec.update({(k, n): _step(llm, n, k) / unit for n in DRAFT_REQUESTS})
        del llm
    draft, verify = [], []
    for n in DRAFT_REQUESTS:
        extra1, extra4 = spec[(1, n)] - _at(curve, 2 * n), spec[(4, n)] - _at(curve, 5 * n)
        d = max((extra4 - extra1) / 3, 0.0)
        draft.append([n, round(d, 3)])
        verify.append([n, round(max(extra1 - d, 0.0), 3)])
    print(f"one-row target step: {unit * 1000:.2f} ms")
    print(json.dumps({"target": [[n, round(t, 3)] for n, t in curve], "draft": draft, "verify": verify}))


if __name__ == "__main__":
    main()
