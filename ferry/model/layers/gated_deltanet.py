"""Qwen3.5's Gated DeltaNet: linear attention whose per-head state is a [k_dim, v_dim] matrix.

One product gives q, k, v, the gate z and the per-head b, a. q, k, v pass a causal depthwise
convolution (SiLU) whose window of the last K - 1 inputs is part of each request's state; q and k
are L2-normed (q also scaled by k_dim ** -0.5). Each token t then decays the state S by
exp(g_t), g_t = -exp(A_log) * softplus(a_t + dt_bias), and writes the delta rule's correction:
S += k_t (beta_t (v_t - S^T k_t))^T with beta_t = sigmoid(b_t); its output is S^T q_t. The output
heads are RMS-normed (plain w), times silu(z), and go through out_proj.

Prefill chunks run the chunk-parallel form (``CHUNK`` tokens at a time, as transformers'
``torch_chunk_gated_delta_rule`` and flash-linear-attention's chunked kernel do) from the slot's
state; decode rows take one recurrent step together. The state matrix is kept as transformers
keeps it, [v_heads, k_dim, v_dim] (out = q @ S), in float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ferry.model.arch.parts import GatedDeltaNetSpec
from ferry.model.fused_decode import Op
from ferry.model.layers.context import StepContext
from ferry.model.layers.linear import Weight, linear
from ferry.model.layers.recurrent import conv_decode, conv_prefill, initial, spans
from ferry.model.quant import packed

CHUNK = 64  # tokens per block of the chunk-parallel delta rule (transformers' and flash-linear-attention's)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (flash-linear-attention's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's T tokens, ``chunk`` at a time: within a chunk by a
    triangular solve (the UT transform) and products, across chunks by carrying the state.
    q, k: [H, T, dk] (normed; q scaled); v: [H, T, dv]; g (log decay), beta: [H, T]; state:
    [H, dk, dv]. All float32. Returns (outputs [H, T, dv], the state after the last token)."""
    H, T, dk = k.shape
    pad = (-T) % chunk  # padded tokens have k = v = 0 and g = 0: they leave the state as it is
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(H, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(H, n, chunk).cumsum(-1)  # log of the decay from the chunk's start to each token
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_v)
    for i in range(n):  # the scan over chunks: each reads the state the ones before it left
        v_new = new_v[:, i] - k_cum[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, n * chunk, -1)[:, :T], state


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences. q, k: [B, H, dk]; v: [B, H, dv]; g, beta: [B, H]; state:
    [B, H, dk, dv]. Returns (outputs [B, H, dv], the new states)."""
    state = state * g.exp()[..., None, None]
    remembered = (k.unsqueeze(-2) @ state).squeeze(-2)  # what the state already gives for k
    delta = (v - remembered) * beta[..., None]
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dimension, times the plain weight, times silu(z) (all float32)."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x * F.silu(z.float())


@dataclass
class GatedDeltaNet:
    in_proj: Weight  # [conv_dim + v_heads * v_dim + 2 * v_heads, hidden]: q, k, v's rows, z's, b's, a's
    conv: torch.Tensor  # [conv_dim, K]: each channel's taps, oldest first
    neg_A: torch.Tensor  # [v_heads] float32: -exp(A_log)
    dt_bias: torch.Tensor  # [v_heads] float32
    norm: torch.Tensor  # [v_dim] float32: the gated norm's plain weight
    out_proj: Weight  # [hidden, v_heads * v_dim]
    spec: GatedDeltaNetSpec
    end = "out_proj"  # the profiler's name for the residual add after it

    @classmethod
    def build(cls, spec: GatedDeltaNetSpec, w: dict[str, Any], facts: Any) -> "GatedDeltaNet":
        return cls(packed(w["gdn_in"]), w["gdn_conv"].squeeze(1).contiguous(), -w["gdn_A_log"].float().exp(),
                   w["gdn_dt_bias"].float(), w["gdn_norm"].float(), packed(w["gdn_out"]), spec)

    def _qkv(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The convolved rows -> q, k [T, v_heads, k_dim] (normed; q scaled), v [T, v_heads, v_dim];
        g, beta [T, v_heads]; float32."""
        s, T = self.spec, x.shape[0]
        kd = s.k_heads * s.k_dim
        q, k, v = x.float().split([kd, kd, s.v_heads * s.v_dim], dim=-1)
        q = l2norm(q.reshape(T, s.k_heads, s.k_dim)) * s.k_dim ** -0.5
        k = l2norm(k.reshape(T, s.k_heads, s.k_dim))
        if s.v_heads != s.k_heads:  # a q/k head serves v_heads // k_heads value heads: consecutive, or tiled
            r = s.v_heads // s.k_heads
            q, k = ((t.repeat(1, r, 1) if s.v_tiled else t.repeat_interleave(r, dim=1)) for t in (q, k))
        g = self.neg_A * F.softplus(a.float() + self.dt_bias)
        return q, k, v.reshape(T, s.v_heads, s.v_dim), g, b.float().sigmoid()

    def forward(self, h: torch.Tensor, ctx: StepContext, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """h: [T, hidden] normed rows (decodes first, then prefill chunks); ``cache["conv"]``
        [num_slots, K - 1, conv_dim] and ``cache["ssm"]`` [num_slots, v_heads, k_dim, v_dim], read
        and written in place."""
        s, kern, meta, T = self.spec, ctx.use_kernel, ctx.meta, h.shape[0]
        windows, states = cache["conv"], cache["ssm"]
        vd = s.v_heads * s.v_dim
        mixed, z, b, a = linear(h, self.in_proj, use_kernel=kern).split([s.conv_dim, vd, s.v_heads, s.v_heads], -1)
        ctx.tick("in_proj")
        nd = meta.num_decodes
        slots = meta.decode_state_slots
        x = torch.empty_like(mixed)
        if nd:  # one step for every decode, each from and to its own slot
            x[:nd], windows[slots] = conv_decode(mixed[:nd], self.conv, None, windows[slots], silu=True)
        for rows, span in spans(meta):  # a chunk may end inside the window: the window carries it
            x[rows], windows[span.state_slot] = conv_prefill(mixed[rows], self.conv, None, initial(windows, span),
                                                             silu=True)
        ctx.tick("conv")
        q, k, v, g, beta = self._qkv(x, a, b)
        o = torch.empty(T, s.v_heads, s.v_dim, dtype=torch.float32, device=h.device)
        if nd:
            o[:nd], states[slots] = recurrent_step(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], states[slots])
        for rows, span in spans(meta):  # each chunk from its slot's state (zeros at the sequence's start)
            out, states[span.state_slot] = chunk_delta_rule(
                q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1), g[rows].t(), beta[rows].t(),
                initial(states, span))
            o[rows] = out.transpose(0, 1)
        ctx.tick("delta_rule")
        o = gated_rms_norm(o, z.reshape(T, s.v_heads, s.v_dim), self.norm, ctx.eps)
        return linear(o.reshape(T, vd).to(h.dtype), self.out_proj, use_kernel=kern)

    def ops(self, ctx: StepContext, cache: Any) -> list[Op]:
        s, hidden = self.spec, self.in_proj.shape[1]
        n_in, vd = self.in_proj.shape[0], s.v_heads * s.v_dim
        states = (cache["conv"], cache["ssm"]) if isinstance(cache, dict) else None
        return [Op("matmul", "h", "rin", "in_proj", w=self.in_proj, n=n_in, k=hidden, width=n_in),
                Op("gdn", "rin", "rout", "recurrent", w=self.conv, w2=self.norm, w3=self.neg_A, w4=self.dt_bias,
                   cache=states, width=vd, shape=(s.k_heads, s.v_heads, s.k_dim, s.v_dim, s.conv_kernel, int(s.v_tiled))),
                Op("matmul", "rout", "out", "out_proj", w=self.out_proj, n=hidden, k=vd, width=hidden)]
