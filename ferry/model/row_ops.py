"""The C per-row operations of prefill and mixed steps (``kernels/row_ops.c``): RMS norm, rope in
place, the MLP's gated activation. The same row code as the fused decode, one pass per row where
torch makes several, each with a temporary. Float32, contiguous rows."""
from __future__ import annotations

import ctypes

import torch

from ferry.model.kernels import load_kernels


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of every row of x [T, H] (rows may be strided), as a new contiguous tensor."""
    x = x if x.stride(1) == 1 else x.contiguous()  # a transposed product's output
    T, H = x.shape
    assert x.dtype == torch.float32
    out = torch.empty(T, H, dtype=x.dtype)
    load_kernels().rms_norm_rows(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), T, H, ctypes.c_float(eps))
    return out


def rope_rows_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor) -> None:
    """Rotate the first ``heads`` heads of every row of x [T, >= heads * head_dim] in place, row t
    at ``positions[t]`` of the tables cos, sin [positions, head_dim]."""
    assert x.stride(1) == 1 and x.dtype == torch.float32 and positions.dtype == torch.int64
    assert cos.is_contiguous() and sin.is_contiguous() and positions.is_contiguous()
    load_kernels().rope_rows(x.data_ptr(), x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                             positions.data_ptr(), x.shape[0])


def gated_act_rows(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate) * up of gate_up [T, 2 I] (gate first): SiLU, or tanh-approximated GELU with ``gelu``."""
    gate_up = gate_up.contiguous()
    T, I2 = gate_up.shape
    out = torch.empty(T, I2 // 2, dtype=gate_up.dtype)
    load_kernels().gated_act_rows(gate_up.data_ptr(), out.data_ptr(), T, I2 // 2, int(gelu))
    return out
