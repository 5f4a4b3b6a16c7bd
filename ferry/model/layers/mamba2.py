"""Mamba2's selective state-space mixer (SSD), as transformers' Mamba2 / GraniteMoeHybrid /
NemotronH mixers compute it: in_proj -> z, xBC, dt; a causal depthwise convolution with SiLU on xBC
(its window of the last K - 1 inputs is part of each request's state); x, B, C; the scan
h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t; an RMS norm of y * silu(z) per
group of channels; out_proj.

A prefill chunk runs the scan in its chunk-parallel (SSD) form from the slot's state: within each
chunk of ``chunk_size`` tokens a masked, decayed C B^T product, between chunks a recurrence over the
chunks' states. Decode rows (one token each, of different requests) run the one-step form together.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ferry.model.arch.parts import Mamba2Spec
from ferry.model.fused_decode import NotFused, Op
from ferry.model.layers.context import StepContext
from ferry.model.layers.linear import Weight, linear
from ferry.model.layers.recurrent import conv_decode, conv_prefill, initial, spans
from ferry.model.quant import packed


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[..., i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the
    diagonal (exp gives the causal decay mask). Summed from j + 1 on, not as a difference of
    cumulative sums, which loses the small sums to cancellation."""
    L = a.shape[-1]
    grid = a[..., None].expand(*a.shape, L)  # [..., i, j] = a[i]
    strict = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)
    sums = grid.masked_fill(~strict, 0).cumsum(dim=-2)
    return sums.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=a.device).tril(), float("-inf"))


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             chunk: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's scan in the chunk-parallel form, float32. x: [T, H, P]; dt: [T, H] (after
    softplus); A: [H]; B, C: [T, H, N] (one row per head); state: [H, P, N] before the first token.
    Returns (y [T, H, P] without the D skip, the state after the last token)."""
    T = x.shape[0]
    pad = (-T) % chunk  # zero steps at the end: no input and no decay, so the final state is T's
    n = (T + pad) // chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).view(n, chunk, *t.shape[1:])

    xdt = chunks(x * dt[..., None])  # [n, L, H, P]
    a = chunks(dt * A).permute(0, 2, 1)  # [n, H, L]: each step's log decay
    Bc, Cc = chunks(B), chunks(C)  # [n, L, H, N]
    cum = a.cumsum(dim=-1)
    # Within each chunk: y_l = sum_{s <= l} (C_l . B_s) exp(a_{s+1} + ... + a_l) dt_s x_s.
    scores = torch.einsum("clhn,cshn->chls", Cc, Bc) * torch.exp(segment_sums(a))
    y = torch.einsum("chls,cshp->clhp", scores, xdt)
    # Each chunk's own contribution to the state at its end, then the state at each chunk's start.
    to_end = torch.exp(cum[..., -1:] - cum)  # [n, H, L]
    own = torch.einsum("clhn,chl,clhp->chpn", Bc, to_end, xdt)  # [n, H, P, N]
    states = torch.cat([state[None].to(own.dtype), own])  # [n + 1, H, P, N]
    between = torch.exp(segment_sums(F.pad(cum[..., -1].t(), (1, 0))))  # [H, n + 1, n + 1]
    starts = torch.einsum("hcz,zhpn->chpn", between, states)  # [n + 1]: chunk c's start; the last, the end
    y = y + torch.einsum("clhn,chpn->clhp", Cc, starts[:-1]) * torch.exp(cum).permute(0, 2, 1)[..., None]
    return y.reshape(n * chunk, *x.shape[1:])[:T], starts[-1]


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """w * rms_norm(y * silu(z)) with the norm over each of ``groups`` equal groups of channels, in
    float32 (y, z: [T, C]); the result float32."""
    g = y.float() * F.silu(z.float())
    g = g.view(g.shape[0], groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * g.view(g.shape[0], -1)


@dataclass
class Mamba2:
    in_proj: Weight  # [inner + conv_dim + heads, hidden]: z's rows, xBC's, dt's
    conv: torch.Tensor  # [conv_dim, K]: each channel's taps, oldest first
    dt_bias: torch.Tensor  # [heads] float32
    A: torch.Tensor  # [heads] float32: -exp(A_log)
    D: torch.Tensor  # [heads] float32
    norm: torch.Tensor  # [inner]: the gated norm's plain w
    out_proj: Weight  # [hidden, inner]
    spec: Mamba2Spec
    conv_bias: torch.Tensor | None = None
    in_bias: torch.Tensor | None = None
    out_bias: torch.Tensor | None = None
    end = "out_proj"  # the profiler's name for the residual add after it

    @classmethod
    def build(cls, spec: Mamba2Spec, w: dict[str, Any], facts: Any) -> "Mamba2":
        return cls(packed(w["ssm_in"]), w["ssm_conv1d"].squeeze(1).contiguous(), w["ssm_dt"].float(),
                   -torch.exp(w["ssm_a"].float()), w["ssm_d"].float(), w["ssm_norm"], packed(w["ssm_out"]), spec,
                   w.get("ssm_conv1d_bias"), w.get("ssm_in_bias"), w.get("ssm_out_bias"))

    def forward(self, h: torch.Tensor, ctx: StepContext, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """h: [T, hidden] normed rows (decodes first, then prefill chunks); ``cache``: "conv"
        [slots, K - 1, conv_dim] and "ssm" [slots, heads, head_dim, d_state], read and written in place."""
        s, kern, meta = self.spec, ctx.use_kernel, ctx.meta
        conv_state, ssm_state = cache["conv"], cache["ssm"]
        zxbcdt = linear(h, self.in_proj, self.in_bias, use_kernel=kern)
        ctx.tick("in_proj")
        z, xbc, dt = zxbcdt.split([s.inner, s.conv_dim, s.heads], dim=-1)
        y = torch.zeros(h.shape[0], s.heads, s.head_dim, dtype=torch.float32, device=h.device)
        nd = meta.num_decodes
        if nd:  # one step for every decode, each from and to its own slot
            slots = meta.decode_state_slots
            xbc_d, conv_state[slots] = conv_decode(xbc[:nd], self.conv, self.conv_bias, conv_state[slots], silu=True)
            y[:nd], ssm_state[slots] = self._step(xbc_d, dt[:nd], ssm_state[slots])
        for rows, span in spans(meta):  # a chunk may end anywhere: the window and the state carry it
            xbc_p, conv_state[span.state_slot] = conv_prefill(xbc[rows], self.conv, self.conv_bias,
                                                               initial(conv_state, span), silu=True)
            y[rows], ssm_state[span.state_slot] = self._scan(xbc_p, dt[rows], initial(ssm_state, span))
        ctx.tick("scan")
        out = gated_rms_norm(y.view(h.shape[0], s.inner), z, self.norm, s.n_groups, ctx.eps).to(h.dtype)
        return linear(out, self.out_proj, self.out_bias, use_kernel=kern)

    def _inputs(self, xbc: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """float32 x [T, H, P], B and C [T, H, N] (each head its group's), dt [T, H] after softplus."""
        s = self.spec
        x, B, C = xbc.float().split([s.inner, s.n_groups * s.d_state, s.n_groups * s.d_state], dim=-1)
        per_group = s.heads // s.n_groups
        B = B.reshape(-1, s.n_groups, s.d_state).repeat_interleave(per_group, dim=1)
        C = C.reshape(-1, s.n_groups, s.d_state).repeat_interleave(per_group, dim=1)
        # transformers clamps to time_step_limit in its chunked form only; (0, inf), every published
        # limit, makes the clamp a no-op, and one rule here keeps a token's output the same whichever
        # form computes it.
        dt = F.softplus(dt.float() + self.dt_bias).clamp(*s.dt_limit)
        return x.reshape(-1, s.heads, s.head_dim), B, C, dt

    def _scan(self, xbc: torch.Tensor, dt: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One prefill chunk from ``state``: (y [T, H, P], the state after it)."""
        x, B, C, dt = self._inputs(xbc, dt)
        y, last = ssd_scan(x, dt, self.A, B, C, self.spec.chunk_size, state)
        return y + self.D[:, None] * x, last

    def _step(self, xbc: torch.Tensor, dt: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row from its state [B, H, P, N]: (y [B, H, P], the new states)."""
        x, B, C, dt = self._inputs(xbc, dt)
        decay = torch.exp(dt * self.A)[..., None, None]  # [B, H, 1, 1]
        state = state * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]
        return torch.einsum("bhpn,bhn->bhp", state, C) + self.D[:, None] * x, state

    def ops(self, ctx: StepContext, cache: Any) -> list[Op]:
        s, hidden = self.spec, self.in_proj.shape[1]
        if self.in_bias is not None or self.out_bias is not None:
            raise NotFused("the fused C decode's Mamba2 has no projection biases")
        n_in = s.inner + s.conv_dim + s.heads
        params = torch.cat([self.dt_bias, self.A, self.D, torch.tensor(s.dt_limit, dtype=torch.float32)]).contiguous()
        states = (cache["conv"], cache["ssm"]) if isinstance(cache, dict) else None
        return [Op("matmul", "h", "rin", "in_proj", w=self.in_proj, n=n_in, k=hidden, width=n_in),
                Op("mamba2", "rin", "rout", "recurrent", w=self.conv, w2=self.conv_bias, w3=params,
                   w4=self.norm.float().contiguous(), cache=states, width=s.inner,
                   shape=(s.inner, s.n_groups, s.d_state, s.heads, s.head_dim, s.conv_kernel)),
                Op("matmul", "rout", "out", "out_proj", w=self.out_proj, n=hidden, k=s.inner, width=hidden)]
