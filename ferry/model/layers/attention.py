"""Softmax attention over the paged KV cache: the qkv product (with its bias), per-head q/k norms,
rope (of whole heads, or of each head's first ``rotary_dim`` values), the cache write, attention
over every earlier token or a sliding window, an output gate where q_proj emits one (Qwen3.5), the
o product."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ferry.model.arch.parts import AttentionSpec
from ferry.model.attention import paged_attention
from ferry.model.fused_decode import Op
from ferry.model.layers.context import StepContext
from ferry.model.layers.linear import Weight, linear
from ferry.model.layers.norm import rms_norm
from ferry.model.layers.rope import apply_rope
from ferry.model.quant import packed
from ferry.model.row_ops import rope_rows_


@dataclass
class Attention:
    qkv: Weight  # [(Hq + 2 Hkv) * D, hidden]: this rank's heads
    qkv_bias: torch.Tensor | None
    o_proj: Weight
    heads: tuple[int, int, int]  # this rank's (query heads, KV heads, head size)
    scale: float
    q_norm: torch.Tensor | None = None  # [head_dim]: per-head RMS norm of q and k before rope (Qwen3)
    k_norm: torch.Tensor | None = None
    window: int | None = None  # sliding window (None: every earlier token)
    rope: int = 0  # which of the model's rope tables it rotates with
    rotary_dim: int | None = None  # rope turns each head's first rotary_dim values only (None: all)
    output_gate: bool = False  # qkv's q rows are each head's q then its gate: out * sigmoid(gate) before o
    sinks: torch.Tensor | None = None  # [this rank's query heads]: sink logits in each softmax denominator
    o_bias: torch.Tensor | None = None  # [hidden]: added after the o product (gpt-oss)
    end = "o_proj"  # the profiler's name for the residual add after it

    @classmethod
    def build(cls, spec: AttentionSpec, w: dict[str, Any], facts: Any) -> "Attention":
        hq, hkv, hd = facts.heads
        return cls(packed(w["qkv"]), w.get("qkv_bias"), packed(w["o"]), facts.heads,
                   spec.scale if spec.scale is not None else hd ** -0.5, w.get("q_norm"), w.get("k_norm"),
                   spec.window, facts.rope_index(spec), spec.rotary_dim, spec.output_gate, w.get("sinks"),
                   w.get("o_bias"))

    def forward(self, h: torch.Tensor, ctx: StepContext, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T, kern, tick = h.shape[0], ctx.use_kernel, ctx.tick
        hq, hkv, hd = self.heads
        q_size, kv_size = hq * hd, hkv * hd
        qkv = linear(h, self.qkv, self.qkv_bias, use_kernel=kern)
        qkv = qkv.contiguous() if kern else qkv  # rows for the C rope (a transposed product's are not)
        tick("qkv")
        if self.output_gate or self.rotary_dim:
            q, k, v, gate = self._split_and_rotate(qkv, ctx)
            tick("rope")
            o = paged_attention(q, k, v, cache[0], cache[1], ctx.meta, self.scale, use_kernel=kern, window=self.window,
                                sinks=self.sinks)
            tick("attention")
            return linear(o if gate is None else o * torch.sigmoid(gate), self.o_proj, self.o_bias, use_kernel=kern)
        # q and k sit side by side in qkv: rotate them in one pass.
        qk = qkv[:, :q_size + kv_size].view(T, hq + hkv, hd)
        if self.q_norm is not None:
            qk = torch.cat([rms_norm(qk[:, :hq], self.q_norm, ctx.eps), rms_norm(qk[:, hq:], self.k_norm, ctx.eps)],
                           dim=1)
        if kern:  # in place: on qkv's rows, or on the normed copy's
            rope_rows_(qkv if self.q_norm is None else qk.view(T, -1), hq + hkv, hd, *ctx.ropes[self.rope],
                       ctx.positions)
        else:
            qk = apply_rope(qk, *ctx.rotations[self.rope])
        q, k = qk[:, :hq], qk[:, hq:]
        v = qkv[:, q_size + kv_size:].view(T, hkv, hd)
        tick("rope")
        o = paged_attention(q, k, v, cache[0], cache[1], ctx.meta, self.scale, use_kernel=kern, window=self.window,
                            sinks=self.sinks)
        tick("attention")
        return linear(o, self.o_proj, self.o_bias, use_kernel=kern)

    def _split_and_rotate(self, qkv: torch.Tensor, ctx: StepContext
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q [T, Hq, D], k, v [T, Hkv, D] (normed, rotated) and the gate [T, Hq * D] (None without
        one), by torch: the C rope rotates whole heads, and the gate's rows sit between q's heads."""
        T = qkv.shape[0]
        hq, hkv, hd = self.heads
        q_size, kv_size = hq * hd, hkv * hd
        gate = None
        if self.output_gate:  # each head's rows: its q, then its gate
            qg = qkv[:, :2 * q_size].reshape(T, hq, 2 * hd)
            q, gate, rest = qg[..., :hd], qg[..., hd:].reshape(T, q_size), qkv[:, 2 * q_size:]
        else:
            q, rest = qkv[:, :q_size].reshape(T, hq, hd), qkv[:, q_size:]
        qk = torch.cat([q, rest[:, :kv_size].reshape(T, hkv, hd)], dim=1)
        v = rest[:, kv_size:].reshape(T, hkv, hd)
        if self.q_norm is not None:
            qk = torch.cat([rms_norm(qk[:, :hq], self.q_norm, ctx.eps), rms_norm(qk[:, hq:], self.k_norm, ctx.eps)],
                           dim=1)
        if ctx.rotations is not None:
            cos, sin = ctx.rotations[self.rope]
        else:  # the kernel path keeps only the tables
            cos, sin = (t[ctx.positions].unsqueeze(1) for t in ctx.ropes[self.rope])
        rd = self.rotary_dim or hd  # the table is rd wide
        qk = torch.cat([apply_rope(qk[..., :rd], cos, sin), qk[..., rd:]], dim=-1)
        return qk[:, :hq], qk[:, hq:], v, gate

    def ops(self, ctx: StepContext, cache: tuple[torch.Tensor, torch.Tensor]) -> list[Op]:
        hq, hkv, hd = self.heads
        gated = self.output_gate
        n_qkv, hidden = (hq * (2 if gated else 1) + 2 * hkv) * hd, self.qkv.shape[1]
        ops = [Op("matmul", "h", "qkv", "qkv", w=self.qkv, n=n_qkv, k=hidden, width=n_qkv)]
        if self.qkv_bias is not None:
            ops.append(Op("bias", "qkv", "qkv", "qkv", w=self.qkv_bias, n=n_qkv))
        # Qwen3.5: each q head's gate follows it in the row (q heads 2 * hd apart), and rope turns the
        # first rotary_dim values of each head.
        ops += [Op("rope_kv", "qkv", "q", "rope", w=self.q_norm, w2=self.k_norm, cache=cache, rope=ctx.ropes[self.rope],
                   width=hq * hd, k=2 * hd if gated else 0, n=self.rotary_dim or 0),
                Op("attention", "q", "attn", "attention", w=self.sinks, cache=cache, n=self.window or 0,
                   scale=self.scale, width=hq * hd)]
        if gated:
            ops.append(Op("gate", "qkv", "attn", "attention", n=hq, k=hd))
        ops.append(Op("matmul", "attn", "out", "o_proj", w=self.o_proj, n=hidden, k=hq * hd, width=hidden))
        if self.o_bias is not None:  # gpt-oss (one rank only: its plan refuses tensor parallelism)
            ops.append(Op("bias", "out", "out", "o_proj", w=self.o_bias, n=hidden))
        return ops
