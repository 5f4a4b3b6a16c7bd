"""Qwen3.5's Gated DeltaNet: linear attention whose per-head state is a [k_dim, v_dim] matrix.

One product gives q, k, v, the gate z and the per-head b, a. q, k, v pass a causal depthwise
convolution (SiLU) whose window of the last K - 1 inputs is part of each request's state; q and k
are L2-normed (q also scaled by k_dim ** -0.5). Each token t then decays the state S by
exp(g_t), g_t = -exp(A_log) * softplus(a_t + dt_bias), and writes the delta rule's correction:
S += k_t (beta_t (v_t - S^T k_t))^T with beta_t = sigmoid(b_t); its output is S^T q_t. The output
heads are RMS-normed (plain w), times silu(z), and go through out_proj.

Prefill chunks run the chunk-parallel form (``CHUNK`` tokens at a time, as transformers'
``torch_chunk_gated_delta_rule`` and flash-linear-attention's chunked kernel do) from the slot's
state: with the C kernels one call per chunk (kernels/recurrent_prefill.c: each thread takes whole
heads through their blocks, q and k normed as it reads them), else torch ops batched over all blocks
of all heads, only the scan over blocks in a Python loop. Decode rows take one recurrent step
together. The state matrix is kept as transformers keeps it, [v_heads, k_dim, v_dim] (out = q @ S),
in float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ferry.model.arch.parts import GatedDeltaNetSpec
from ferry.model.fused_decode import Op
from ferry.model.kernels import load_kernels
from ferry.model.layers.context import StepContext
from ferry.model.layers.linear import Weight, linear
from ferry.model.layers.recurrent import conv_decode, conv_prefill, initial, spans
from ferry.model.quant import packed

CHUNK = 64  # tokens per block of the chunk-parallel delta rule (transformers' and flash-linear-attention's)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (flash-linear-attention's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _blocks(x: torch.Tensor, n: int, chunk: int) -> torch.Tensor:
    """x [T, H, d] (token-major; rows may be strided) as n blocks of ``chunk`` tokens per head,
    [n, H, chunk, d] contiguous, zeros past T (k = v = 0, g = beta = 0: they leave the state as it is)."""
    T, H, d = x.shape
    out = x.new_empty(n, H, chunk, d)
    tokens = out.transpose(1, 2)  # [n, chunk, H, d]: the blocks seen token-major
    full, rest = divmod(T, chunk)
    if full:
        tokens[:full].copy_(x[:full * chunk].reshape(full, chunk, H, d))
    if rest:
        tokens[full, :rest].copy_(x[full * chunk:])
        tokens[full, rest:].zero_()
    return out


def _unblock(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Blocks x [n, H, chunk, d] back into out [T, H, d] (T <= n * chunk), token-major."""
    n, H, chunk, d = x.shape
    tokens = x.transpose(1, 2)
    full, rest = divmod(out.shape[0], chunk)
    if full:
        out[:full * chunk].view(full, chunk, H, d).copy_(tokens[:full])
    if rest:
        out[full * chunk:].copy_(tokens[full, :rest])
    return out


def delta_rule_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, chunk: int = CHUNK,
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's T tokens, token-major, ``chunk`` at a time: within
    a chunk by a triangular solve (the UT transform) and products, across chunks by carrying the
    state. Everything but the scan over chunks runs for all chunks of all heads at once.
    q, k: [T, H, dk] (normed; q scaled); v: [T, H, dv]; g (log decay), beta: [T, H]; state:
    [H, dk, dv]. Returns (outputs [T, H, dv], in ``out`` when given; the state after the last token)."""
    T, H, dk = k.shape
    dv = v.shape[-1]
    n = -(-T // chunk)
    nb = n * H  # the blocks: each chunk of each head
    qb, kb, vb = (_blocks(x, n, chunk) for x in (q, k, v))
    cum, bb = (_blocks(x.unsqueeze(-1), n, chunk) for x in (g, beta))  # [n, H, chunk, 1]
    cum = cum.cumsum(2)  # log of the decay from the chunk's start to each token
    e = cum.exp()
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum - cum.transpose(-1, -2)).masked_fill_(upper, float("-inf")).exp_().view(nb, chunk, chunk)
    q3, k3 = qb.view(nb, chunk, dk), kb.view(nb, chunk, dk)
    ut = torch.bmm(k3, k3.transpose(1, 2)).mul_(pair).mul_(bb.view(nb, chunk, 1))  # beta_i k_i.k_j decay(j..i)
    intra = torch.bmm(q3, k3.transpose(1, 2)).mul_(pair)
    w = (kb * (bb * e)).view(nb, chunk, dk)
    u = vb.mul_(bb).view(nb, chunk, dv)
    for x in (w, u):  # the UT transform, in place
        torch.linalg.solve_triangular(ut, x, upper=False, unitriangular=True, out=x)
    w, u = w.view(n, H, chunk, dk), u.view(n, H, chunk, dv)
    qb.mul_(e)
    kd = kb.mul_((cum[:, :, -1:] - cum).exp_())  # k decayed to its chunk's end
    decay = e[:, :, -1:]  # [n, H, 1, 1]: each chunk's decay of the state
    S = qb.new_empty(n + 1, H, dk, dv)  # the state before each chunk, then after the last
    S[0] = state
    for i in range(n):  # the scan over chunks: each reads the state the ones before it left
        u[i].baddbmm_(w[i], S[i], alpha=-1)  # the corrections: what the state does not already give
        torch.mul(S[i], decay[i], out=S[i + 1]).baddbmm_(kd[i].transpose(-1, -2), u[i])
    o = torch.bmm(q3, S[:n].view(nb, dk, dv)).baddbmm_(intra, u.view(nb, chunk, dv))
    if out is None:
        out = o.new_empty(T, H, dv)
    return _unblock(o.view(n, H, chunk, dv), out), S[n]


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_rule_chunks head-major: q, k: [H, T, dk]; v: [H, T, dv]; g, beta: [H, T]; state
    [H, dk, dv]. Returns (outputs [H, T, dv], the state after the last token)."""
    o, state = delta_rule_chunks(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t(), state,
                                 chunk)
    return o.transpose(0, 1), state


def delta_rule_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, state_out: torch.Tensor, out: torch.Tensor, norm: bool = False,
                      tiled: bool = False, chunk: int = CHUNK) -> None:
    """delta_rule_chunks by the C kernel (kernels/recurrent_prefill.c), float32, one parallel region:
    each thread takes whole heads through all chunks. q, k: [T, hk, dk], hk dividing v's heads (value
    head h reads q/k head h % hk when ``tiled``, else h // (H // hk)), raw with ``norm`` (L2-normed
    there, q scaled by dk ** -0.5); v: [T, H, dv]; g, beta: [T, H]; rows may be strided. Writes the
    outputs into ``out`` [T, H, dv] and the final state into ``state_out`` (may be ``state`` itself)."""
    T, hk, dk = q.shape
    H, dv = v.shape[1:]
    q, k, v, g, beta = (x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()
                        for x in (q, k, v, g, beta))
    if k.stride() != q.stride():
        q, k = q.contiguous(), k.contiguous()
    if beta.stride() != g.stride():
        g, beta = g.contiguous(), beta.contiguous()
    state = state.contiguous()
    assert all(x.dtype == torch.float32 for x in (q, k, v, g, beta, state, state_out, out))
    assert out.stride()[1:] == (dv, 1) and state_out.is_contiguous() and H % hk == 0
    shape = torch.tensor([T, H, dk, dv, chunk, q.stride(0), v.stride(0), g.stride(0), out.stride(0), hk, int(tiled),
                          int(norm)], dtype=torch.int64)
    if load_kernels().gdn_prefill(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                  state.data_ptr(), state_out.data_ptr(), out.data_ptr(), shape.data_ptr()):
        raise MemoryError("the delta rule kernel's scratch")


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
    return F.rms_norm(x, (x.shape[-1],), weight, eps).mul_(F.silu(z.float()))  # one fused norm


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

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The convolved rows -> q, k [T, v_heads, k_dim] (normed; q scaled), v [T, v_heads, v_dim];
        float32."""
        s, T = self.spec, x.shape[0]
        kd = s.k_heads * s.k_dim
        q, k, v = x.float().split([kd, kd, s.v_heads * s.v_dim], dim=-1)
        q = l2norm(q.reshape(T, s.k_heads, s.k_dim)) * s.k_dim ** -0.5
        k = l2norm(k.reshape(T, s.k_heads, s.k_dim))
        if s.v_heads != s.k_heads:  # a q/k head serves v_heads // k_heads value heads: consecutive, or tiled
            r = s.v_heads // s.k_heads
            q, k = ((t.repeat(1, r, 1) if s.v_tiled else t.repeat_interleave(r, dim=1)) for t in (q, k))
        return q, k, v.reshape(T, s.v_heads, s.v_dim)

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g (log decay), beta [T, v_heads] float32."""
        return self.neg_A * F.softplus(a.float() + self.dt_bias), b.float().sigmoid()

    def _chunk_kernel(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                      state_out: torch.Tensor, out: torch.Tensor) -> None:
        """One prefill chunk's delta rule by the C kernel, q, k, v read (and q, k normed) from the
        convolved rows x [T, conv_dim] float32."""
        s, T = self.spec, x.shape[0]
        kd = s.k_heads * s.k_dim
        q, k, v = x.split([kd, kd, s.v_heads * s.v_dim], dim=-1)
        q, k, v = q.view(T, s.k_heads, s.k_dim), k.view(T, s.k_heads, s.k_dim), v.view(T, s.v_heads, s.v_dim)
        delta_rule_kernel(q, k, v, g, beta, state, state_out, out, norm=True, tiled=s.v_tiled)

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
        x = mixed.new_empty(mixed.shape)  # row-major whatever the product's layout: the C chunks read its rows
        if nd:  # one step for every decode, each from and to its own slot
            x[:nd], windows[slots] = conv_decode(mixed[:nd], self.conv, None, windows[slots], silu=True)
        for rows, span in spans(meta):  # a chunk may end inside the window: the window carries it
            windows[span.state_slot] = conv_prefill(mixed[rows], self.conv, None, initial(windows, span), silu=True,
                                                    use_kernel=kern, out=x[rows])[1]
        ctx.tick("conv")
        g, beta = self._gates(a, b)
        fused = kern and x.dtype == torch.float32  # the C chunks read q, k, v from x and norm q, k there
        q, k, v = self._qkv(x[:nd] if fused else x)
        o = torch.empty(T, s.v_heads, s.v_dim, dtype=torch.float32, device=h.device)
        if nd:
            o[:nd], states[slots] = recurrent_step(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], states[slots])
        for rows, span in spans(meta):  # each chunk from its slot's state (zeros at the sequence's start)
            if fused:  # in place: each head's state is read whole before it is written
                self._chunk_kernel(x[rows], g[rows], beta[rows], initial(states, span), states[span.state_slot],
                                   o[rows])
            else:
                states[span.state_slot] = delta_rule_chunks(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                                            initial(states, span), out=o[rows])[1]
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
