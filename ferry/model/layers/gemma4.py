"""Gemma 4's parts: its attention (q/k norms, a scale-less norm of v, per-layer head sizes, and
layers that read the K/V an earlier layer wrote this step instead of keeping their own), the
per-layer input block after the MLP, and the per-layer input embeddings it reads.

The fused C decode has no op for a per-row input (the per-layer embeddings), a norm of v or a
layer's own head size: these parts raise NotFused and a Gemma 4 model decodes through torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ferry.model.arch.parts import Gemma4AttentionSpec, LayerSpec
from ferry.model.attention import paged_attention
from ferry.model.fused_decode import NotFused, Op
from ferry.model.layers.context import StepContext
from ferry.model.layers.linear import Weight, linear
from ferry.model.layers.mlp import ACTIVATIONS
from ferry.model.layers.norm import rms_norm
from ferry.model.layers.rope import apply_rope
from ferry.model.quant import packed


@dataclass
class Gemma4Attention:
    qkv: Weight  # q's rows, then k's and v's (none where the layer shares K/V; no v's with k_eq_v)
    o_proj: Weight
    heads: tuple[int, int, int]  # (query heads, KV heads, head size) of this layer
    q_norm: torch.Tensor
    k_norm: torch.Tensor | None  # None: the layer shares another's K/V
    window: int | None
    rope: int  # which of the model's rope tables (one as wide as the head) it rotates with
    shared: bool  # reads the K/V its source layer wrote (its cache is that layer's)
    k_eq_v: bool = False
    scale: float = 1.0
    end = "o_proj"  # the profiler's name for the residual add after it

    @classmethod
    def build(cls, spec: Gemma4AttentionSpec, w: dict[str, Any], facts: Any) -> "Gemma4Attention":
        hq, hkv, hd = facts.heads
        heads = (hq, spec.kv_heads or hkv, spec.head_dim or hd)
        return cls(packed(w["qkv"]), packed(w["o"]), heads, w["q_norm"], w.get("k_norm"), spec.window,
                   facts.rope_index(spec), spec.kv_source is not None, spec.k_eq_v,
                   1.0 if spec.scale is None else spec.scale)

    def _rotate(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if ctx.rotations is not None:
            cos, sin = ctx.rotations[self.rope]
        else:  # the kernel path keeps only the tables
            cos, sin = (t[ctx.positions].unsqueeze(1) for t in ctx.ropes[self.rope])
        return apply_rope(x, cos, sin)

    def forward(self, h: torch.Tensor, ctx: StepContext, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T, kern = h.shape[0], ctx.use_kernel
        hq, hkv, hd = self.heads
        qkv = linear(h, self.qkv, use_kernel=kern)
        ctx.tick("qkv")
        q = self._rotate(rms_norm(qkv[:, :hq * hd].reshape(T, hq, hd), self.q_norm, ctx.eps), ctx)
        k = v = None
        if not self.shared:
            k = qkv[:, hq * hd:(hq + hkv) * hd].reshape(T, hkv, hd)
            v = k if self.k_eq_v else qkv[:, (hq + hkv) * hd:].reshape(T, hkv, hd)
            v = F.rms_norm(v, (hd,), None, ctx.eps)  # no scale: each head's values normed only
            k = self._rotate(rms_norm(k, self.k_norm, ctx.eps), ctx)
        ctx.tick("rope")
        o = paged_attention(q.contiguous(), k, v, cache[0], cache[1], ctx.meta, self.scale, use_kernel=kern,
                            window=self.window)
        ctx.tick("attention")
        return linear(o, self.o_proj, use_kernel=kern)

    def ops(self, ctx: StepContext, cache: Any) -> list[Op]:
        raise NotFused("the fused C decode has no norm of v nor per-layer head sizes (Gemma 4)")


@dataclass
class PerLayerInput:
    """x += norm(proj(act(gate(x)) * this layer's per-layer input)): the block after Gemma 4's MLP
    (no norm before it: the decoder's Residual without one)."""

    gate: Weight  # [width, hidden]
    proj: Weight  # [hidden, width]
    index: int  # the layer's index: its share of the per-layer inputs
    act: str = "gelu_tanh"
    end = "down"  # the profiler's name for the residual add after it

    @classmethod
    def build(cls, spec: LayerSpec, w: dict[str, Any], index: int) -> "PerLayerInput":
        return cls(packed(w["ple_gate"]), packed(w["ple_proj"]), index, getattr(spec.mlp, "act", "gelu_tanh"))

    def forward(self, h: torch.Tensor, ctx: StepContext, cache: Any = None) -> torch.Tensor:
        g = ACTIVATIONS[self.act](linear(h, self.gate, use_kernel=ctx.use_kernel))
        return linear(g * ctx.per_layer[:, self.index], self.proj, use_kernel=ctx.use_kernel)

    def ops(self, ctx: StepContext, cache: Any = None) -> list[Op]:
        raise NotFused("the fused C decode has no per-row input (Gemma 4's per-layer embeddings)")


@dataclass
class PerLayerInputs:
    """Every layer's per-layer input of each token, [T, layers, width]: (norm(proj(x) / sqrt(hidden))
    + the token's per-layer embedding * sqrt(width)) / sqrt(2), x the scaled token embedding."""

    embed: torch.Tensor  # [per-layer vocabulary, layers * width]
    proj: Weight  # [layers * width, hidden]
    norm: torch.Tensor  # [width]
    layers: int
    width: int

    def __call__(self, input_ids: torch.Tensor, x: torch.Tensor, eps: float, use_kernel: bool) -> torch.Tensor:
        T = input_ids.shape[0]
        token = self.embed[input_ids] * torch.tensor(self.width ** 0.5, dtype=self.embed.dtype)
        proj = linear(x, self.proj, use_kernel=use_kernel) * x.shape[1] ** -0.5
        proj = rms_norm(proj.reshape(T, self.layers, self.width), self.norm, eps)
        return (proj + token.reshape(T, self.layers, self.width)) * 2.0 ** -0.5
