"""The C decode kernel and the torch reference path agree on random paged caches."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ferry.model.attention import AttentionMetadata, decode_attention_kernel, decode_attention_torch
from ferry.model.kernels import load_kernels
from ferry.model.kv_format import quantize_q8_0


def as_cache(x: torch.Tensor, kv_dtype) -> torch.Tensor:
    """Random K or V rows in a cache's element format ("q8_0": llama.cpp's blocks)."""
    return quantize_q8_0(x) if kv_dtype == "q8_0" else x.to(kv_dtype)


# (8, 1, 512): Gemma 4 E2B's global layers, eight query heads on one KV head of 512.
SHAPES = [(9, 3, 64), (4, 4, 32), (8, 2, 40), (6, 2, 96), (8, 1, 512)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("hq,hkv,d,kv_dtype", [s + (t,) for s in SHAPES for t in (torch.float32, torch.bfloat16, torch.float16)]
                         + [s + ("q8_0",) for s in SHAPES if s[2] % 32 == 0])  # q8_0: blocks of 32
def test_kernel_matches_reference(block_size, hq, hkv, d, kv_dtype):
    """Contexts shorter than a tile, across tiles and across the kernel's ranges (split and merged),
    grouped and plain heads, a head size that is no multiple of the vector width, and each KV
    cache dtype (16-bit caches widened as read, q8_0 blocks dequantized: the same values torch
    reads)."""
    compare_on_random_cache(block_size, hq, hkv, d, kv_dtype, window=None)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [5, 37, 300])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference_with_a_window_starting_mid_block(block_size, window, kv_dtype):
    """A sliding window's first slot lies inside a block (and a range's first slot with it)."""
    compare_on_random_cache(block_size, 9, 3, 64, kv_dtype, window=window)


def compare_on_random_cache(block_size: int, hq: int, hkv: int, d: int, kv_dtype, window: int | None) -> None:
    """The kernel and the torch path on one batch of contexts, 1 to 700 slots, in scattered blocks."""
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
    k_cache = as_cache(torch.randn(num_blocks * block_size, hkv, d, generator=g), kv_dtype)
    v_cache = as_cache(torch.randn(num_blocks * block_size, hkv, d, generator=g), kv_dtype)
    q = torch.randn(len(lens), hq, d, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=len(lens),
                             decode_block_tables=table, decode_lens=torch.tensor(lens), block_size=block_size,
                             prefills=[])
    ref = decode_attention_torch(q, k_cache, v_cache, meta, d ** -0.5, window)
    got = decode_attention_kernel(q, k_cache, v_cache, meta, d ** -0.5, window)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,n,k", [(1, 7, 8), (3, 4, 64), (5, 13, 576), (16, 1001, 1536), (32, 64, 24)])
def test_skinny_gemm_matches_torch(m, n, k):
    from ferry.model.layers.linear import skinny_linear

    if load_kernels() is None:
        pytest.fail("the kernels could not be built (no C compiler?)")
    g = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    torch.testing.assert_close(skinny_linear(x, w), x @ w.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_the_fused_decode_writes_the_cache_as_torch_rounds(kv_dtype):
    """The C decode writes new K/V into a 16-bit cache rounded to nearest even, as torch's .to()
    does (subnormals, overflow to infinity, NaN stays NaN): the same cache whichever path wrote it."""
    import ctypes

    from ferry.model.kernels import load_kernels

    lib = load_kernels()
    if lib is None:
        pytest.fail("the kernels could not be built (no C compiler?)")
    x = torch.cat([torch.randn(4000) * 10.0 ** torch.randint(-9, 6, (4000,)),
                   torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e-8, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -24,
                                 6.1e-5, 2.0 ** -14 * (1 - 2 ** -11), float("inf"), float("nan"), 1.0 + 2 ** -8,
                                 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11])])
    x = torch.cat([x, -x])
    out = torch.empty(x.numel(), dtype=kv_dtype)
    lib.kv_store(out.data_ptr(), x.data_ptr(), x.numel(), {torch.bfloat16: 1, torch.float16: 2}[kv_dtype])
    want = x.to(kv_dtype)
    same = (out.view(torch.int16) == want.view(torch.int16)) | (torch.isnan(out.float()) & torch.isnan(want.float()))
    assert bool(same.all()), x[~same][:5]


def test_the_fused_decode_writes_q8_0_blocks_as_the_torch_path_does():
    """The C store and kv_format.quantize_q8_0 give the same bytes (scales rounded to float16,
    levels rounded half away from zero, all-zero blocks, huge and tiny values: below float16's
    range a scale is 0 and the block reads back as zeros, as in llama.cpp), and blocks of normal
    magnitudes read back within half a level (plus the float16 scale's rounding) of the input."""
    lib = load_kernels()
    if lib is None:
        pytest.fail("the kernels could not be built (no C compiler?)")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=g) * 10.0 ** torch.randint(-9, 5, (64, 1), generator=g)
    x[0] = 0.0
    x[1, :] = torch.arange(32) - 15.5  # exact halves: ties
    x[2, :5] = torch.tensor([127.0, -63.5, 0.5, -0.5, 1.5])
    x = x.flatten()
    out = torch.empty(x.numel() // 32 * 34, dtype=torch.uint8)
    lib.kv_store(out.data_ptr(), x.data_ptr(), x.numel(), 3)
    assert torch.equal(out, quantize_q8_0(x))
    from ferry.model.kv_format import dequantize_q8_0

    back, x = dequantize_q8_0(out).view(-1, 32), x.view(-1, 32)
    step = x.abs().amax(1, keepdim=True) / 127
    normal = (step > 2.0 ** -14).flatten()  # scales float16 holds as normal numbers
    assert normal.sum() > 16
    assert bool(((back - x).abs() <= step * (0.5 + 127 * 2.0 ** -11))[normal].all())
