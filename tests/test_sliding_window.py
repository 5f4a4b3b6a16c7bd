"""Sliding-window attention: no windowed layer reads a slot outside its window (prefill chunks,
decodes, verify rows; torch and C paths), and the KV cache gives back blocks every window has passed."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings, strategies as st

from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.request import Request
from ferry.core.sampling_params import SamplingParams
from ferry.model.attention import AttentionMetadata, PrefillSpan, paged_attention
from ferry.model.kernels import load_kernels

HQ, HKV, D = 4, 2, 16  # D a multiple of the vector width: the C kernels take it


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int], window: int) -> torch.Tensor:
    """Each query at position p over keys (p - window, p], from the dense K/V of every position."""
    out = []
    for i, p in enumerate(positions):
        lo = max(0, p - window + 1)
        kk = k[lo:p + 1].repeat_interleave(HQ // HKV, dim=1)  # [L, Hq, D]
        vv = v[lo:p + 1].repeat_interleave(HQ // HKV, dim=1)
        w = torch.softmax(torch.einsum("hd,lhd->hl", q[i], kk) / math.sqrt(D), dim=-1)
        out.append(torch.einsum("hl,lhd->hd", w, vv).reshape(-1))
    return torch.stack(out)


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4, 8]), ctx=st.integers(0, 40),
       q_len=st.integers(1, 10), decode=st.booleans(), kernel=st.booleans(), seed=st.integers(0, 1000))
def test_windowed_attention_never_reads_outside_the_window(window, block_size, ctx, q_len, decode, kernel, seed):
    if decode and ctx == 0:
        ctx = 1  # a decode row has context
    g = torch.Generator().manual_seed(seed)
    n = ctx + q_len
    k_all, v_all = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
    q = torch.randn(q_len, HQ, D, generator=g)
    nblocks = -(-n // block_size) + 3
    table = torch.randperm(nblocks, generator=g)[: -(-n // block_size)]
    slots = table[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
    # Every slot no query can see holds NaN: reading one (even masked, as 0 * NaN) poisons the output.
    k_cache = torch.full((nblocks * block_size, HKV, D), float("nan"))
    v_cache = k_cache.clone()
    first_seen = max(0, ctx - window + 1)
    k_cache[slots[first_seen:ctx]], v_cache[slots[first_seen:ctx]] = k_all[first_seen:ctx], v_all[first_seen:ctx]
    new = slice(ctx, n)
    positions = list(range(ctx, n))
    if decode:  # decode / verify rows: one per token, each with its own context length
        meta = AttentionMetadata(slot_mapping=slots[new], num_decodes=q_len,
                                 decode_block_tables=table.repeat(q_len, 1), decode_lens=torch.arange(ctx, n) + 1,
                                 block_size=block_size, prefills=[], max_decode_len=n)
    else:
        span = PrefillSpan(0, q_len, ctx)
        if ctx:
            span.ctx_slots = slots
        meta = AttentionMetadata(slot_mapping=slots[new], num_decodes=0, decode_block_tables=None,
                                 decode_lens=None, block_size=block_size, prefills=[span])
    use_kernel = kernel and load_kernels() is not None
    out = paged_attention(q, k_all[new], v_all[new], k_cache, v_cache, meta, D ** -0.5, use_kernel=use_kernel,
                          window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(q, k_all, v_all, positions, window), atol=1e-5, rtol=1e-5)


def _request(n: int) -> Request:
    return Request("r", list(range(n)), SamplingParams(), arrival_time=0.0)


@settings(max_examples=80, deadline=None)
@given(window=st.integers(1, 20), block_size=st.sampled_from([1, 2, 4, 8]), caching=st.booleans(),
       steps=st.lists(st.integers(1, 9), min_size=1, max_size=25))
def test_blocks_every_window_has_passed_are_given_back(window, block_size, caching, steps):
    kv = KVCacheManager(200, block_size, enable_caching=caching, window=window)
    req = _request(sum(steps))
    for n in steps:  # each step computes n more tokens, then the scheduler's after-step calls
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        kv.cache_blocks(req)
        kv.release_outside_window(req)
        table = kv.block_tables["r"]
        first_seen = max(0, req.num_computed_tokens - window + 1)
        released = kv.released.get("r", 0)
        # Nothing a future query sees is given back; everything before it is.
        assert released * block_size <= first_seen
        assert released == min(first_seen // block_size, len(table))
        held = table[released:]
        assert len(set(held)) == len(held) and all(kv.pool.ref_counts[b] == 1 for b in held)
        # A given-back block is free, or taken again (by this request: its later positions).
        assert all(kv.pool.ref_counts[b] == 0 for b in table[:released] if b not in held)
        assert kv.pool.num_used == len(held)
    kv.free(req)
    assert kv.pool.num_used == 0


def test_a_full_attention_model_keeps_every_block():
    kv = KVCacheManager(50, 4, window=None)
    req = _request(40)
    kv.allocate_slots(req, 40)
    req.num_computed_tokens = 40
    kv.release_outside_window(req)
    assert kv.pool.num_used == 10


def test_a_windowed_model_holds_only_its_window_of_blocks(tmp_path):
    from ferry import LLM
    from tests.arch_models import hf_greedy, make_model

    model = make_model("mistral", tmp_path)  # window 8 on every layer
    llm = LLM(model=str(tmp_path), block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert llm.engine.kv.window == 8
    prompt = list(range(3, 43))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, min_tokens=30), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, 30)
    # 70 tokens would take 18 blocks; the window (8 positions) plus a step's 16 new ones span at most 7.
    used = [s.num_kv_blocks_used for s in llm.engine.step_stats]
    assert max(used) <= 7 and llm.engine.kv.pool.num_used == 0
