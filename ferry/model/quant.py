"""GGUF-quantized weights kept quantized in memory (Q4_0, Q4_1, Q8_0, Q4_K), and products with them.

``load_gguf_weights`` reads a llama GGUF straight into Hugging Face names: float tensors as
float32, quantized ones repacked for the C kernel (``kernels/quant_gemm.c``, which documents the
layout). ``quant_linear`` multiplies float32 activations with a quantized weight: the kernel for
few rows, and for many rows the weight dequantized in slices into one reused buffer, then BLAS.
Either way the result is the float32 model's (the dequantization is the gguf library's, bit for
bit), up to the order of the sums.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ferry.model.kernels import load_kernels
from ferry.model.shard_plan import QK  # GGUF blocks of 32 weights

# GGUF type name -> (the kernel's type id, repacked bytes per block of 32). Q4_K's sub-blocks of 32
# (a scale and a min each) are exactly Q4_1 blocks once their scales are multiplied out.
KERNEL_TYPES = {"Q4_0": (0, 20), "Q4_1": (1, 24), "Q8_0": (2, 36), "Q4_K": (1, 24)}
FLOAT_TYPES = ("F32", "F16", "BF16")

# Up to this many rows the kernel's product wins; above it, dequantize-then-BLAS (measured with
# `ferry bench kernels`: BLAS's packing pays off once the weight is reused by many rows).
KERNEL_ROWS = 32
# Weights are dequantized for BLAS in slices of at most this many floats (16 MiB), so the buffer
# stays small whatever the matrix (the LM head has 28M weights).
SLICE_FLOATS = 4 * 2**20


@dataclass
class QuantWeight:
    """A [N, K] weight kept in the kernel's repacked blocks (``data``: uint8 [N, K/32 * block])."""

    data: torch.Tensor
    qtype: str
    shape: tuple[int, int]

    @property
    def kernel_type(self) -> int:
        return KERNEL_TYPES[self.qtype][0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def repack(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> QuantWeight:
    """GGUF blocks (float16 scales) of a [N, K] tensor -> the kernel's blocks (float32 scales)."""
    n, k = shape
    if qtype == "Q4_K":
        return _repack_q4_k(raw, shape)
    nb = k // QK
    src = raw.reshape(n, nb, -1)
    out = np.empty((n, nb, KERNEL_TYPES[qtype][1]), dtype=np.uint8)
    d = src[..., 0:2].copy().view(np.float16).astype(np.float32)
    out[..., 0:4] = d.view(np.uint8)
    if qtype == "Q4_1":
        out[..., 4:8] = src[..., 2:4].copy().view(np.float16).astype(np.float32).view(np.uint8)
        out[..., 8:] = src[..., 4:]
    else:
        out[..., 4:] = src[..., 2:]
    return QuantWeight(torch.from_numpy(out.reshape(n, -1)), qtype, shape)


def _repack_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> QuantWeight:
    """Q4_K super-blocks (256 weights: float16 d and dmin, 6-bit scales and mins, 4-bit quants) ->
    Q4_1 blocks with scale d * sc and min -(dmin * m): the gguf library's d * sc * q - dmin * m,
    bit for bit (q * (d * sc) is exact in float32)."""
    from gguf.quants import Q4_K

    n, k = shape
    src = raw.reshape(-1, 144)
    d = src[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = src[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(src[:, 4:16].copy())
    scale = d * sc.astype(np.float32)  # [blocks, 8 sub-blocks]
    low = -(dmin * mn.astype(np.float32))
    # Each 32 bytes of quants hold two sub-blocks: low nibbles the first, high nibbles the second.
    qs = src[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    vals = (qs & 15).reshape(-1, 8, 32)
    out = np.empty((src.shape[0], 8, KERNEL_TYPES["Q4_K"][1]), dtype=np.uint8)
    out[..., 0:4] = scale.reshape(-1, 8, 1).view(np.uint8)
    out[..., 4:8] = low.reshape(-1, 8, 1).view(np.uint8)
    out[..., 8:] = vals[..., :16] | (vals[..., 16:] << 4)
    return QuantWeight(torch.from_numpy(out.reshape(n, -1)), "Q4_K", shape)


def dequantize(w: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 rows of ``w`` (all of them, or those in ``rows``: embedding lookups)."""
    n = w.shape[0] if rows is None else rows.numel()
    out = torch.empty(n, w.shape[1], dtype=torch.float32)
    ids = None if rows is None else rows.to(torch.int64).contiguous()
    load_kernels().quant_dequant(w.data.data_ptr(), None if ids is None else ids.data_ptr(),
                                 out.data_ptr(), n, w.shape[1], w.kernel_type)
    return out


def quant_linear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] float32 @ dequant(w).T -> [M, N]."""
    x = x.contiguous()
    m, (n, k) = x.shape[0], w.shape
    lib = load_kernels()
    if m <= KERNEL_ROWS:
        y = torch.empty(m, n, dtype=torch.float32)
        lib.quant_gemm(x.data_ptr(), w.data.data_ptr(), y.data_ptr(), m, n, k, w.kernel_type)
        return y
    step = max(1, SLICE_FLOATS // k)
    buf = torch.empty(min(n, step), k, dtype=torch.float32)
    if n <= step:
        lib.quant_dequant(w.data.data_ptr(), None, buf.data_ptr(), n, k, w.kernel_type)
        return torch.mm(x, buf.t())
    # A large matrix (an LM head) in row slices of y.T: each slice of the weight is dequantized
    # and used at once, while in cache.
    yt = torch.empty(n, m, dtype=torch.float32)
    row_bytes = w.data.shape[1]
    for n0 in range(0, n, step):
        rows = min(step, n - n0)
        lib.quant_dequant(w.data.data_ptr() + n0 * row_bytes, None, buf.data_ptr(), rows, k, w.kernel_type)
        torch.mm(buf[:rows], x.t(), out=yt[n0:n0 + rows])
    return yt.t().contiguous()


def cat_rows(ws: list[torch.Tensor | QuantWeight]) -> torch.Tensor | QuantWeight:
    """Stack weights along the output dimension (fused qkv, gate+up); float32 if the types differ."""
    if all(isinstance(w, QuantWeight) for w in ws) and len({w.kernel_type for w in ws}) == 1:
        return QuantWeight(torch.cat([w.data for w in ws]).contiguous(), ws[0].qtype,
                           (sum(w.shape[0] for w in ws), ws[0].shape[1]))
    return torch.cat([dequantize(w) if isinstance(w, QuantWeight) else w for w in ws]).contiguous()


CACHE_FILE = "ferry-quantized.safetensors"


def cached_gguf_weights(path: Path, cache_dir: Path) -> dict[str, torch.Tensor | QuantWeight]:
    """``load_gguf_weights``, saved once in ``cache_dir`` (the converted model's directory):
    parsing a GGUF's metadata takes seconds (the whole vocabulary), loading the saved tensors
    a fraction of one."""
    from safetensors.torch import load_file, save_file

    cached = cache_dir / CACHE_FILE
    if cached.is_file():
        from safetensors import safe_open

        with safe_open(str(cached), "pt") as f:
            kinds = json.loads(f.metadata()["ferry"])
        tensors = load_file(str(cached))
        return {name: QuantWeight(tensors[name], kinds[name][0], tuple(kinds[name][1])) if name in kinds
                else tensors[name] for name in tensors}
    weights = load_gguf_weights(path)
    kinds = {n: (w.qtype, w.shape) for n, w in weights.items() if isinstance(w, QuantWeight)}
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    save_file({n: w.data if isinstance(w, QuantWeight) else w for n, w in weights.items()}, str(tmp),
              metadata={"ferry": json.dumps(kinds)})
    tmp.replace(cached)
    return weights


def load_gguf_weights(path: Path) -> dict[str, torch.Tensor | QuantWeight]:
    """Every tensor of a llama GGUF under its Hugging Face name; quantized ones stay quantized.

    Raises ValueError naming the tensor and its type when a type is neither a float nor one the
    kernel supports (serve such a file with ``quantization="none"``, which dequantizes it all).
    """
    from gguf import GGUFReader

    from ferry.model.gguf_convert import hf_name, permuted_heads, unpermute_rope

    reader = GGUFReader(str(path))
    n_heads, n_kv = permuted_heads(reader)  # (0, 0): q/k rows as Hugging Face keeps them
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        # GGUF lists dimensions innermost first: [K, N] for an N x K matrix.
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        heads = n_heads if t.name.endswith("attn_q.weight") else n_kv if t.name.endswith("attn_k.weight") else 0
        if qtype in FLOAT_TYPES:
            w = np.asarray(t.data).astype(np.float32).reshape(shape)
            out[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(unpermute_rope(w, heads) if heads else w))
        elif qtype in KERNEL_TYPES and len(shape) == 2 and shape[1] % QK == 0:
            raw = np.asarray(t.data).reshape(shape[0], -1)
            # Rope's row permutation moves whole rows, and a row's blocks move with it.
            out[hf_name(t.name)] = repack(unpermute_rope(raw, heads) if heads else raw, qtype, shape)
        else:
            raise ValueError(f"{path.name}: tensor {t.name!r} has GGUF type {qtype}, which ferry cannot keep "
                             f"quantized (supported: {', '.join(KERNEL_TYPES)}); use --quantization none")
    return out
