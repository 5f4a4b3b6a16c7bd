"""What the recurrent parts share: their per-request state in slots, and the causal depthwise
convolution with its cached window.

A recurrent layer's cache is a dict of float32 tensors, one per kind of state, each
``[num_state_slots, *shape]`` (the spec's ``state_shapes``). In a step, decode rows (the first
``meta.num_decodes`` rows, each a different request) read and write the slots in
``meta.decode_state_slots``; each prefill chunk (``meta.prefills``) starts from its slot's state,
or from zeros when it starts the sequence (``ctx_len == 0``), and leaves its final state there.
A convolution's window is kept time-major, ``[K - 1, channels]``: the last K - 1 inputs.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ferry.model.attention import AttentionMetadata, PrefillSpan
from ferry.model.kernels import load_kernels


def spans(meta: AttentionMetadata) -> Iterator[tuple[slice, PrefillSpan]]:
    """Each prefill chunk's rows and span, in order."""
    for p in meta.prefills:
        yield slice(p.q_start, p.q_start + p.q_len), p


def initial(state: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
    """A chunk's starting state from its slot of ``state`` (zeros when the chunk starts its sequence)."""
    s = state[span.state_slot]
    return torch.zeros_like(s) if span.ctx_len == 0 else s


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor,
                 silu: bool, use_kernel: bool = False,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's causal depthwise convolution. x: [T, C]; weight: [C, K]; window: [K - 1, C], the
    inputs before the chunk. Returns (y [T, C] in x's dtype, in ``out`` when given, the new window
    [K - 1, C] float32). With ``use_kernel`` (float32 rows) one C pass over the rows."""
    T, K = x.shape[0], weight.shape[1]
    if use_kernel and x.dtype == torch.float32:
        return _conv_rows(x if x.stride(1) == 1 else x.contiguous(), weight, bias, window, silu, out)
    # time-major rows: K shifted multiply-adds (a depthwise F.conv1d over [C, T] is far slower on CPU)
    xp = torch.cat([window.to(x.dtype), x])  # [T + K - 1, C]
    w = weight.t().to(x.dtype)
    y = torch.mul(xp[:T], w[0], out=out)
    for j in range(1, K):
        y.addcmul_(xp[j:j + T], w[j])
    if bias is not None:
        y += bias.to(x.dtype)
    return (F.silu(y, inplace=True) if silu else y), xp[T:].float()


def _conv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor, silu: bool,
               out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """conv_prefill by the C kernel (kernels/recurrent_prefill.c): float32, x's channels contiguous."""
    T, C = x.shape
    K = weight.shape[1]
    taps = weight.t().float().contiguous()  # [K, C]: each tap's row over the channels
    window = window.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    y = out if out is not None and out.is_contiguous() else torch.empty(T, C, dtype=torch.float32)
    new_window = torch.empty(K - 1, C, dtype=torch.float32)
    load_kernels().conv_rows(x.data_ptr(), x.stride(0), window.data_ptr(), taps.data_ptr(),
                             None if bias is None else bias.data_ptr(), y.data_ptr(), new_window.data_ptr(),
                             T, C, K, int(silu))
    return (y if out is None or out is y else out.copy_(y)), new_window


def conv_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, windows: torch.Tensor,
                silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. x: [B, C]; windows: [B, K - 1, C]. Returns (y [B, C], new windows)."""
    xp = torch.cat([windows.to(x.dtype), x.unsqueeze(1)], dim=1)  # [B, K, C]
    y = torch.einsum("bkc,ck->bc", xp, weight.to(x.dtype))
    if bias is not None:
        y = y + bias.to(x.dtype)
    return (F.silu(y) if silu else y), xp[:, 1:].float()
