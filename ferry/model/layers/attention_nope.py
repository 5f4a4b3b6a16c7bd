"""Softmax attention over the paged KV cache without rotating q and k: in the Mamba2 hybrids
(Granite 4's "nope", Nemotron-H) the recurrent layers carry the order of the tokens."""
from __future__ import annotations

from typing import Any

import torch

from ferry.model.attention import paged_attention
from ferry.model.fused_decode import Op
from ferry.model.layers.attention import Attention
from ferry.model.layers.context import StepContext
from ferry.model.layers.linear import linear
from ferry.model.layers.norm import rms_norm


class NoRopeAttention(Attention):
    """``Attention``'s weights and options, without the rotation (its rope table goes unread)."""

    def forward(self, h: torch.Tensor, ctx: StepContext, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T, kern = h.shape[0], ctx.use_kernel
        hq, hkv, hd = self.heads
        qkv = linear(h, self.qkv, self.qkv_bias, use_kernel=kern)
        ctx.tick("qkv")
        q = qkv[:, :hq * hd].view(T, hq, hd)
        k = qkv[:, hq * hd:(hq + hkv) * hd].view(T, hkv, hd)
        v = qkv[:, (hq + hkv) * hd:].view(T, hkv, hd)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, ctx.eps), rms_norm(k, self.k_norm, ctx.eps)
        o = paged_attention(q, k, v, cache[0], cache[1], ctx.meta, self.scale, use_kernel=kern, window=self.window,
                            sinks=self.sinks)
        ctx.tick("attention")
        return linear(o, self.o_proj, use_kernel=kern)

    def ops(self, ctx: StepContext, cache: Any) -> list[Op]:
        hq, hkv, hd = self.heads
        n_qkv, hidden = (hq + 2 * hkv) * hd, self.qkv.shape[1]
        ops = [Op("matmul", "h", "qkv", "qkv", w=self.qkv, n=n_qkv, k=hidden, width=n_qkv)]
        if self.qkv_bias is not None:
            ops.append(Op("bias", "qkv", "qkv", "qkv", w=self.qkv_bias, n=n_qkv))
        # The rope op with no rotation (n < 0): its per-head norms and the K/V cache write.
        return ops + [Op("rope_kv", "qkv", "q", "rope", w=self.q_norm, w2=self.k_norm, cache=cache, width=hq * hd,
                         k=hd, n=-1),
                      Op("attention", "q", "attn", "attention", w=self.sinks, cache=cache, n=self.window or 0,
                         scale=self.scale, width=hq * hd),
                      Op("matmul", "attn", "out", "o_proj", w=self.o_proj, n=hidden, k=hq * hd, width=hidden)]
