"""Products with a weight (float or quantized), by the fastest path for the number of rows."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ferry.model.kernels import load_kernels
from ferry.model.quant import QuantWeight, RowStack, quant_linear

Weight = torch.Tensor | QuantWeight | RowStack

# Float32 weights (quantization none): up to KERNEL_ROWS rows the streaming kernel beats BLAS,
# whose packing of the weight costs more than a product this small; from 16 rows torch (oneDNN)
# is faster (`ferry bench kernels`, 2-core AVX-512 CPU). See linear().
KERNEL_ROWS = 8
TRANSPOSED_ROWS = 128


def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T by the C kernel that streams each weight row once (float32)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    load_kernels().skinny_gemm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0], x.shape[1])
    return y


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None,
           use_kernel: bool = False) -> torch.Tensor:
    """x @ w.T (+ bias), by the fastest path for the number of rows.

    Few rows (decode steps): the streaming C kernel. Up to a few hundred: (w @ x.T).T,
    which lets BLAS read the weight in place. Many rows (prefill): plain BLAS.
    Quantized weights: ``quant_linear`` (which picks its own path).
    """
    m = x.shape[0]
    if isinstance(w, (QuantWeight, RowStack)):
        y = quant_linear(x, w)
    elif use_kernel and m <= KERNEL_ROWS:
        y = skinny_linear(x, w)
    elif m <= TRANSPOSED_ROWS:
        y = torch.mm(w, x.t()).t()
    else:
        return F.linear(x, w, bias)
    return y if bias is None else y + bias
