"""The KV cache's element formats (``--kv-cache-dtype``): how K/V rows are stored and read back.

float32, bfloat16 and float16 are torch dtypes, rounded to nearest even as written. ``q8_0`` is
llama.cpp's: per 32 values one float16 scale and 32 int8 levels (34 bytes, 8.5 bits a value),
stored as uint8 rows of ``D / 32 * 34`` bytes. One definition for the torch path; the C kernels
(``kernels/kv_types.h``) store and read the same bytes, and the tests hold the two together.
"""
from __future__ import annotations

import numpy as np
import torch

from ferry.model.loader import DTYPES

# The kernels' ids of the formats (kv_types.h), by the cache tensor's dtype (q8_0 is the uint8 one).
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.uint8: 3}
Q8_BLOCK, Q8_BYTES = 32, 34
# 1/127 rounded once to float32, as the C side's 1.0f / 127.0f; a product, not a division, so that
# fast math cannot change the C side's rounding.
_INV127 = float(np.float32(1) / np.float32(127))


def cache_dtype(name: str, model_dtype: torch.dtype, q8_activations: bool = False) -> torch.dtype:
    """The cache tensor's dtype for a ``kv_cache_dtype`` setting. ``auto`` is the model's dtype,
    except under q8 activations (llama.cpp's products), where it is float16, llama.cpp's cache
    too: exact mode keeps the float32 model's results, q8 mode takes llama.cpp's speed."""
    auto = torch.float16 if q8_activations and model_dtype == torch.float32 else model_dtype
    return {"auto": auto, "q8_0": torch.uint8, **DTYPES}[name]


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of the cache tensor's last dimension that hold one head's ``head_dim`` values."""
    if dtype == torch.uint8:
        if head_dim % Q8_BLOCK:
            raise ValueError(f"kv_cache_dtype 'q8_0' needs a head_dim that is a multiple of {Q8_BLOCK}; "
                             f"this model's is {head_dim}")
        return head_dim // Q8_BLOCK * Q8_BYTES
    return head_dim


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """[..., D] floats -> [..., D / 32 * 34] uint8 blocks: scale d = amax / 127 (as float16), levels
    round(x / d) with ties away from zero."""
    b = x.float().reshape(*x.shape[:-1], -1, Q8_BLOCK)
    d = b.abs().amax(-1, keepdim=True) * _INV127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    v = b * inv
    t = v.trunc()
    q = t + torch.where((v - t).abs() >= 0.5, v.sign(), torch.zeros_like(v))  # roundf's rounding
    scale = d.to(torch.float16).view(torch.uint8)  # [..., n, 2] little-endian bytes
    blocks = torch.cat([scale, q.to(torch.int8).view(torch.uint8)], dim=-1)
    return blocks.reshape(*x.shape[:-1], -1)


def dequantize_q8_0(blocks: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse view: [..., n * 34] uint8 -> [..., n * 32] of ``dtype`` (level times scale)."""
    b = blocks.reshape(*blocks.shape[:-1], -1, Q8_BYTES)
    d = b[..., :2].contiguous().view(torch.float16).float()
    q = b[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).reshape(*blocks.shape[:-1], -1).to(dtype)


def to_cache(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """K or V rows [T, H, D] in the element format of ``cache``."""
    if cache.dtype == torch.uint8:
        return quantize_q8_0(x)
    return x if x.dtype == cache.dtype else x.to(cache.dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache (any format) as ``dtype`` values."""
    if x.dtype == torch.uint8:
        return dequantize_q8_0(x, dtype)
    return x if x.dtype == dtype else x.to(dtype)
