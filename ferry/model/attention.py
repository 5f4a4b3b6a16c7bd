"""Paged attention over packed tokens.

The packed batch holds single-token decodes first, then prefill chunks. New K/V
are written into the block cache by slot mapping; every query then reads its
request's context through the block table: causal inside its own chunk, full
over the tokens computed in earlier steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """A prefill chunk: ``q_len`` queries from packed row ``q_start``, after ``ctx_len`` cached tokens."""

    q_start: int
    q_len: int
    ctx_len: int
    ctx_slots: torch.Tensor | None = None  # slots of positions [0, ctx_len + q_len) when ctx_len > 0
    mask: torch.Tensor | None = None  # [q_len, ctx_len + q_len], True where a query may look


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, shared by every layer."""

    slot_mapping: torch.Tensor  # [T]: cache slot of every packed token
    num_decodes: int  # the first num_decodes rows are single-token decodes
    decode_slots: torch.Tensor | None  # [B, L]: slots of each decode's context (padded)
    decode_mask: torch.Tensor | None  # [B, 1, 1, L]: True on real context positions
    prefills: list[PrefillSpan]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [slots, Hkv, D]. Returns [T, Hq * D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [B, Hkv, L, D]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        out[:nd] = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True).squeeze(2)
    for p in meta.prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        qp = q[rows].transpose(0, 1).unsqueeze(0)
        if p.ctx_len == 0:
            kp, vp = k[rows], v[rows]
        else:
            kp, vp = k_cache[p.ctx_slots], v_cache[p.ctx_slots]
        o = F.scaled_dot_product_attention(
            qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask, is_causal=p.ctx_len == 0, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out.view(q.shape[0], -1)
