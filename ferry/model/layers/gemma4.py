"""Gemma 4's parts: its attention (q/k norms, a scale-less norm of v, per-layer head sizes, and
layers that read the K/V an earlier layer wrote this step instead of keeping their own), the
per-layer input block after the MLP, and the per-layer input embeddings it reads.

In the fused C decode the attention is ops of the layer's own head counts and size (rows packed:
heads_rope_kv norms v and writes no K/V where the layer shares them, heads_attention), the
per-layer input block multiplies by its share of a per-layer input buffer the decoder fills each
step (act_mul). The experts block has no ops: a Gemma 4 with experts decodes through torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ferry.model.arch.parts import Gemma4AttentionSpec, Gemma4MoESpec, LayerSpec
from ferry.model.attention import paged_attention
from ferry.model.fused_decode import NotFused, Op
from ferry.model.layers.context import StepContext
from ferry.model.layers.experts import RoutedExperts, route
from ferry.model.layers.linear import Weight, linear
from ferry.model.layers.mlp import ACTIVATIONS, GatedMLP
from ferry.model.layers.norm import rms_norm
from ferry.model.layers.rope import apply_rope
from ferry.model.quant import QuantWeight, dequantize, packed


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
        hq, hkv, hd = self.heads
        mode = 2 if self.shared else 1 if self.k_eq_v else 0  # K/V: k and v, k as v, none (read another's)
        n_qkv, hidden = (hq + (2, 1, 0)[mode] * hkv) * hd, self.qkv.shape[1]
        return [Op("matmul", "h", "qkv", "qkv", w=self.qkv, n=n_qkv, k=hidden, width=n_qkv, packed=True),
                Op("heads_rope_kv", "qkv", "q", "rope", w=self.q_norm, w2=self.k_norm, cache=cache,
                   rope=ctx.ropes[self.rope], width=hq * hd, packed=True, shape=(hq, hkv, hd, mode, 1)),
                Op("heads_attention", "q", "attn", "attention", cache=cache, n=self.window or 0, scale=self.scale,
                   width=hq * hd, packed=True, shape=(hq, hkv, hd)),
                Op("matmul", "attn", "out", "o_proj", w=self.o_proj, n=hidden, k=hq * hd, width=hidden, packed=True)]


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
        """Reads x itself (its residual block has no norm); its per-layer input from ``ctx.per_layer``,
        the decoder's buffer of every row's per-layer inputs, filled before each fused step."""
        if ctx.per_layer is None or self.act not in ("gelu_tanh", "silu"):
            raise NotFused("no per-layer input buffer")
        width, hidden = self.gate.shape[0], self.gate.shape[1]
        rows = ctx.per_layer[:, self.index]  # this layer's share of each row: a view, rows layers * width apart
        return [Op("matmul", "x", "gu", "gate_up", w=self.gate, n=width, k=hidden, width=width, packed=True),
                Op("act_mul", "gu", "act", "act", w=rows, width=width, packed=True,
                   shape=(width, rows.stride(0), int(self.act == "gelu_tanh"))),
                Op("matmul", "act", "out", "down", w=self.proj, n=hidden, k=width, width=hidden, packed=True)]


@dataclass
class PerLayerInputs:
    """Every layer's per-layer input of each token, [T, layers, width]: (norm(proj(x) / sqrt(hidden))
    + the token's per-layer embedding * sqrt(width)) / sqrt(2), x the scaled token embedding."""

    embed: Weight  # [per-layer vocabulary, layers * width] (kept quantized where the file is)
    proj: Weight  # [layers * width, hidden]
    norm: torch.Tensor  # [width]
    layers: int
    width: int

    def __call__(self, input_ids: torch.Tensor, x: torch.Tensor, eps: float, use_kernel: bool) -> torch.Tensor:
        T = input_ids.shape[0]
        # A quantized file's embedding (llama.cpp's Q4_K_M) gives up only the rows looked up.
        rows = dequantize(self.embed, input_ids) if isinstance(self.embed, QuantWeight) else self.embed[input_ids]
        token = rows * torch.tensor(self.width ** 0.5, dtype=rows.dtype)
        proj = linear(x, self.proj, use_kernel=use_kernel) * x.shape[1] ** -0.5
        proj = rms_norm(proj.reshape(T, self.layers, self.width), self.norm, eps)
        return (proj + token.reshape(T, self.layers, self.width)) * 2.0 ** -0.5


@dataclass
class Gemma4MoE:
    """Gemma 4's feed-forward block with routed experts (Gemma4MoESpec): reads the block's input x
    unnormed; its output is post_feedforward_layernorm_1(mlp(norm(x))) + post_feedforward_layernorm_2(
    experts(pre_feedforward_layernorm_2(x))), routed on x normed with no weight, times the router's
    scale and hidden ** -0.5, each chosen expert's weight times its per_expert_scale."""

    norm: torch.Tensor  # pre_feedforward_layernorm: the dense MLP's input norm
    mlp: GatedMLP
    mlp_out_norm: torch.Tensor  # post_feedforward_layernorm_1
    experts: RoutedExperts  # its router: router.proj; its top k renormalised
    experts_norm: torch.Tensor  # pre_feedforward_layernorm_2
    experts_out_norm: torch.Tensor  # post_feedforward_layernorm_2
    router_scale: torch.Tensor  # [hidden]
    expert_scale: torch.Tensor  # [experts]
    end = "down"

    @classmethod
    def build(cls, spec: Gemma4MoESpec, w: dict[str, Any], facts: Any) -> "Gemma4MoE":
        experts = RoutedExperts(w["router"], [packed(x) for x in w["expert_gate_up"]],
                                [packed(x) for x in w["expert_down"]], spec.top_k, True, spec.act)
        return cls(w["mlp_norm"], GatedMLP.build(spec, w, facts), w["mlp_out_norm_1"], experts, w["moe_norm"],
                   w["moe_out_norm"], w["router_scale"], w["expert_scale"])

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: Any = None) -> torch.Tensor:
        eps, kern = ctx.eps, ctx.use_kernel
        dense = rms_norm(self.mlp.forward(rms_norm(x, self.norm, eps, kern), ctx), self.mlp_out_norm, eps, kern)
        # transformers' order: the unweighted norm, times the scale, times hidden ** -0.5.
        r = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * self.router_scale * x.shape[-1] ** -0.5
        weights, chosen = route(r, self.experts.router, self.experts.top_k, True)
        weights = weights * self.expert_scale.float()[chosen]
        moe = self.experts.mix(rms_norm(x, self.experts_norm, eps, kern), weights, chosen, ctx)
        return dense + rms_norm(moe, self.experts_out_norm, eps, kern)

    def ops(self, ctx: StepContext, cache: Any = None) -> list[Op]:
        raise NotFused("Gemma 4's experts block (two norms of the residual, a scaled router)")
