"""Prompt logprobs: scored a block of rows at a time, never a log-softmax of
the whole chunk; the same numbers as the plain log-softmax."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ferry.executor.sampler import PROMPT_LOGPROB_BLOCK, prompt_logprobs

V = 4096


def _req(rid: str, prompt: list[int], k: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt,
                           sampling_params=SimpleNamespace(prompt_logprobs=k))


def test_prompt_logprobs_equal_the_log_softmax_of_each_row():
    g = torch.Generator().manual_seed(0)
    n1, n2 = 150, 7
    logits = torch.randn(n1 + n2, V, generator=g) * 5
    a = _req("a", torch.randint(0, V, (n1 + 1,), generator=g).tolist(), 3)
    b = _req("b", torch.randint(0, V, (n2 + 4,), generator=g).tolist(), 0)
    got = prompt_logprobs(logits, [(a, 1, n1), (b, 4, n2)])
    ref = torch.log_softmax(logits, dim=-1)
    first, entries = got["a"]
    assert first == 1 and len(entries) == n1
    for i, e in enumerate(entries):
        tid = a.prompt_token_ids[1 + i]
        assert e[tid] == pytest.approx(float(ref[i, tid]), abs=1e-4)
        top = ref[i].topk(3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert e[t] == pytest.approx(v, abs=1e-4)
    assert [len(e) for e in got["b"][1]] == [1] * n2
    assert got["b"][1][0][b.prompt_token_ids[4]] == pytest.approx(float(ref[n1, b.prompt_token_ids[4]]), abs=1e-4)


def test_no_op_allocates_a_full_vocabulary_row_for_every_prompt_position():
    n = 8 * PROMPT_LOGPROB_BLOCK
    logits = torch.randn(n, V)
    req = _req("a", list(range(n + 1)), 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        prompt_logprobs(logits, [(req, 1, n)])
    biggest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    # A block's row values (float32) at most, twice over for slack; the whole chunk would be 8x one.
    assert biggest <= 2 * PROMPT_LOGPROB_BLOCK * V * 4, biggest
