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


def spans(meta: AttentionMetadata) -> Iterator[tuple[slice, PrefillSpan]]:
    """Each prefill chunk's rows and span, in order."""
    for p in meta.prefills:
        yield slice(p.q_start, p.q_start + p.q_len), p


def initial(state: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
    """A chunk's starting state from its slot of ``state`` (zeros when the chunk starts its sequence)."""
    s = state[span.state_slot]
    return torch.zeros_like(s) if span.ctx_len == 0 else s


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor,
                 silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's causal depthwise convolution. x: [T, C]; weight: [C, K]; window: [K - 1, C], the
    inputs before the chunk. Returns (y [T, C] in x's dtype, the new window [K - 1, C] float32)."""
    K = weight.shape[1]
    xp = torch.cat([window.to(x.dtype), x])  # [T + K - 1, C]
    y = F.conv1d(xp.t().unsqueeze(0), weight.unsqueeze(1).to(x.dtype), None if bias is None else bias.to(x.dtype),
                 groups=x.shape[1])[0].t()
    return (F.silu(y) if silu else y), xp[xp.shape[0] - (K - 1):].float()


def conv_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, windows: torch.Tensor,
                silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. x: [B, C]; windows: [B, K - 1, C]. Returns (y [B, C], new windows)."""
    xp = torch.cat([windows.to(x.dtype), x.unsqueeze(1)], dim=1)  # [B, K, C]
    y = torch.einsum("bkc,ck->bc", xp, weight.to(x.dtype))
    if bias is not None:
        y = y + bias.to(x.dtype)
    return (F.silu(y) if silu else y), xp[:, 1:].float()
