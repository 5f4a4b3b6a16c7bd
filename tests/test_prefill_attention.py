"""The C prefill attention and the torch reference path agree: chunks with and without context,
several chunks and decodes in one step, chunks starting mid-block, contexts crossing tile and block
edges, sliding windows, grouped and plain heads, every KV cache dtype."""
from __future__ import annotations

import pytest
import torch

from ferry.model.attention import AttentionMetadata, PrefillSpan, paged_attention, prefill_attention_kernel
from ferry.model.kernels import load_kernels
from tests.test_attention import as_cache

# (context, chunk) per prefill of the step: no context; context ending mid-block and mid-tile; a
# one-token chunk; a long chunk after a long context.
CHUNKS = [(0, 37), (21, 45), (130, 1), (300, 190)]


def _step(hq: int, hkv: int, d: int, block_size: int, kv_dtype: torch.dtype, decodes: int, seed: int):
    """Random caches, scattered blocks, and the metadata of one step: ``decodes`` decode rows first,
    then every chunk of CHUNKS. Returns q, k, v (the step's new rows), the caches and the metadata."""
    g = torch.Generator().manual_seed(seed)
    lens = [ctx + n for ctx, n in CHUNKS] + [50 + 33 * i for i in range(decodes)]
    need = [-(-n // block_size) for n in lens]
    blocks = torch.randperm(sum(need) + 7, generator=g).tolist()
    tables = [[blocks.pop() for _ in range(k)] for k in need]
    slots = [torch.tensor(t)[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
             for t, n in zip(tables, lens)]
    n_slots = (sum(need) + 7) * block_size
    k_cache = as_cache(torch.randn(n_slots, hkv, d, generator=g), kv_dtype)
    v_cache = as_cache(torch.randn(n_slots, hkv, d, generator=g), kv_dtype)
    new_slots, spans, row = [], [], decodes
    dec = slots[len(CHUNKS):]
    new_slots += [s[-1:] for s in dec]
    for (ctx, n), s in zip(CHUNKS, slots):
        span = PrefillSpan(row, n, ctx)
        if ctx:
            span.ctx_slots = s
        spans.append(span)
        new_slots.append(s[ctx:])
        row += n
    table = torch.zeros(max(decodes, 1), max(need), dtype=torch.long)
    for i, t in enumerate(tables[len(CHUNKS):]):
        table[i, :len(t)] = torch.tensor(t)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(new_slots), num_decodes=decodes, decode_block_tables=table[:decodes] if decodes else None,
        decode_lens=torch.tensor(lens[len(CHUNKS):]) if decodes else None, block_size=block_size, prefills=spans,
        max_decode_len=max(lens[len(CHUNKS):], default=0))
    T = row
    qkv = torch.randn(T, hq + 2 * hkv, d, generator=g)  # q, k and v side by side, as the model has them
    return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], k_cache, v_cache, meta


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, "q8_0"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
@pytest.mark.parametrize("window", [None, 7, 200])
def test_prefill_kernel_matches_reference(hq, hkv, d, block_size, kv_dtype, window):
    if load_kernels() is None:
        pytest.fail("the attention kernels could not be built (no C compiler?)")
    q, k, v, k_cache, v_cache, meta = _step(hq, hkv, d, block_size, kv_dtype, decodes=3, seed=d + block_size)
    caches = (k_cache.clone(), v_cache.clone())
    ref = paged_attention(q, k, v, *caches, meta, d ** -0.5, use_kernel=False, window=window)
    got = paged_attention(q, k, v, k_cache, v_cache, meta, d ** -0.5, use_kernel=True, window=window)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # The kernel served the chunks (the shapes above are multiples of every vector width).
    out = torch.full((q.shape[0], hq, d), float("nan"))
    assert prefill_attention_kernel(q, k_cache, v_cache, meta, d ** -0.5, window, out)
    rows = torch.cat([torch.arange(p.q_start, p.q_start + p.q_len) for p in meta.prefills])
    torch.testing.assert_close(out[rows].view(len(rows), -1), ref[rows], rtol=1e-5, atol=1e-5)


def test_a_head_size_the_kernel_does_not_take_falls_back_to_torch():
    """D = 40 is no multiple of 16 (AVX-512's width): the kernel declines there, torch answers."""
    q, k, v, k_cache, v_cache, meta = _step(8, 2, 40, 4, torch.float32, decodes=0, seed=1)
    caches = (k_cache.clone(), v_cache.clone())
    ref = paged_attention(q, k, v, *caches, meta, 40 ** -0.5, use_kernel=False)
    got = paged_attention(q, k, v, k_cache, v_cache, meta, 40 ** -0.5, use_kernel=load_kernels() is not None)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
