"""LFM2's gated short convolution: in_proj -> B, C, x; y = C * conv(B * x), a causal depthwise
convolution (no activation) whose window of the last K - 1 inputs is each request's state; out_proj."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ferry.model.arch.parts import ShortConvSpec
from ferry.model.fused_decode import NotFused, Op
from ferry.model.layers.context import StepContext
from ferry.model.layers.linear import Weight, linear
from ferry.model.layers.recurrent import conv_decode, conv_prefill, initial, spans
from ferry.model.quant import packed


@dataclass
class ShortConv:
    in_proj: Weight  # [3 * hidden, hidden]: B's rows, C's, x's
    conv: torch.Tensor  # [hidden, K]: each channel's taps, oldest first
    out_proj: Weight  # [hidden, hidden]
    in_bias: torch.Tensor | None = None
    conv_bias: torch.Tensor | None = None
    out_bias: torch.Tensor | None = None
    end = "out_proj"  # the profiler's name for the residual add after it

    @classmethod
    def build(cls, spec: ShortConvSpec, w: dict[str, Any], facts: Any) -> "ShortConv":
        return cls(packed(w["short_conv_in"]), w["short_conv"].squeeze(1).contiguous(), packed(w["short_conv_out"]),
                   w.get("short_conv_in_bias"), w.get("short_conv_bias"), w.get("short_conv_out_bias"))

    def forward(self, h: torch.Tensor, ctx: StepContext, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """h: [T, hidden] normed rows (decodes first, then prefill chunks); ``cache["conv"]``:
        [num_slots, K - 1, hidden] windows, read and written in place."""
        kern, meta, state = ctx.use_kernel, ctx.meta, cache["conv"]
        bcx = linear(h, self.in_proj, self.in_bias, use_kernel=kern)
        ctx.tick("in_proj")
        b, c, x = bcx.chunk(3, dim=-1)
        bx = b * x
        y = torch.empty_like(bx)
        nd = meta.num_decodes
        if nd:  # one step for every decode, each from and to its own slot
            slots = meta.decode_state_slots
            y[:nd], state[slots] = conv_decode(bx[:nd], self.conv, self.conv_bias, state[slots], silu=False)
        for rows, span in spans(meta):  # a chunk may end inside the window: the window carries it
            y[rows], state[span.state_slot] = conv_prefill(bx[rows], self.conv, self.conv_bias, initial(state, span),
                                                           silu=False)
        ctx.tick("conv")
        return linear(c * y, self.out_proj, self.out_bias, use_kernel=kern)

    def ops(self, ctx: StepContext, cache: Any) -> list[Op]:
        hidden, K = self.conv.shape
        if self.in_bias is not None or self.out_bias is not None:
            raise NotFused("the fused C decode's short convolution has no projection biases")
        window = cache["conv"] if isinstance(cache, dict) else None
        return [Op("matmul", "h", "rin", "in_proj", w=self.in_proj, n=3 * hidden, k=hidden, width=3 * hidden),
                Op("short_conv", "rin", "rout", "recurrent", w=self.conv, w2=self.conv_bias, width=hidden,
                   cache=None if window is None else (window, window), shape=(hidden, K)),
                Op("matmul", "rout", "out", "out_proj", w=self.out_proj, n=hidden, k=hidden, width=hidden)]
