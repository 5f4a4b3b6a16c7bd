"""The C decode kernel and the torch reference path agree on random paged caches."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ferry.model.attention import AttentionMetadata, decode_attention_kernel, decode_attention_torch
from ferry.model.kernels import load_kernels


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 40)])
def test_kernel_matches_reference(block_size, hq, hkv, d):
    """Contexts shorter than a tile, across tiles and across the kernel's ranges (split and merged),
    grouped and plain heads, and a head size that is no multiple of the vector width."""
    if load_kernels() is None:
        pytest.fail("the attention kernel could not be built (no C compiler?)")
    g = torch.Generator().manual_seed(block_size)
    num_blocks = 1400 // block_size + 400
    lens = [1, 7, 33, 130, 16 * 3, 257, 700]
    rng = np.random.default_rng(0)
    perm = rng.permutation(num_blocks).tolist()  # scattered, non-contiguous blocks
    tables = []
    for n in lens:
        need = -(-n // block_size)
        tables.append([perm.pop() for _ in range(need)])
    max_blocks = max(len(t) for t in tables)
    table = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t)
    k_cache = torch.randn(num_blocks * block_size, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks * block_size, hkv, d, generator=g)
    q = torch.randn(len(lens), hq, d, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=len(lens),
                             decode_block_tables=table, decode_lens=torch.tensor(lens), block_size=block_size,
                             prefills=[])
    ref = decode_attention_torch(q, k_cache, v_cache, meta, d ** -0.5)
    got = decode_attention_kernel(q, k_cache, v_cache, meta, d ** -0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,n,k", [(1, 7, 8), (3, 4, 64), (5, 13, 576), (16, 1001, 1536), (32, 64, 24)])
def test_skinny_gemm_matches_torch(m, n, k):
    from ferry.model.llama import skinny_linear

    if load_kernels() is None:
        pytest.fail("the kernels could not be built (no C compiler?)")
    g = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    torch.testing.assert_close(skinny_linear(x, w), x @ w.t(), rtol=1e-4, atol=1e-4)
