"""Paged attention over packed tokens.

The packed batch holds single-token decodes first, then prefill chunks. New K/V
are written into the block cache by slot mapping; every query then reads its
request's context through the block table: causal inside its own chunk, full
over the tokens computed in earlier steps. A layer with a sliding window of W
(``window``) lets the query at position p see positions (p - W, p] only, and never
gathers a slot before every query's window (those blocks may be given back). A layer with
attention sinks (``sinks``: one logit per query head, gpt-oss) adds each head's sink to every
softmax denominator: the softmax runs over [scores, sink] and the sink's share is dropped.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ferry.model.kernels import load_kernels
from ferry.model.kv_format import KV_KINDS, from_cache, to_cache


@dataclass
class PrefillSpan:
    """A prefill chunk: ``q_len`` queries from packed row ``q_start``, after ``ctx_len`` cached tokens."""

    q_start: int
    q_len: int
    ctx_len: int
    ctx_slots: torch.Tensor | None = None  # slots of positions [0, ctx_len + q_len) when ctx_len > 0
    state_slot: int = -1  # its request's recurrent-state slot (hybrid models); ctx_len == 0: start from zeros
    # Position ranges [a, b) of its request whose queries also see the range's later keys (an
    # image's tokens, attended both ways: Gemma 3); empty: causal.
    blocks: tuple[tuple[int, int], ...] = ()


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, shared by every layer."""

    slot_mapping: torch.Tensor  # [T]: cache slot of every packed token
    num_decodes: int  # the first num_decodes rows are one-token queries (decodes, verify tokens) with their own context
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] int64
    decode_lens: torch.Tensor | None  # [B] int64: context length, the new token included
    block_size: int
    prefills: list[PrefillSpan]
    max_decode_len: int = 0  # known on the host: no device sync to size the gathered contexts
    decode_state_slots: torch.Tensor | None = None  # [num_decodes] int64: each decode row's recurrent-state slot
    _gathered: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _spans: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def to(self, device: torch.device) -> "AttentionMetadata":
        """The same metadata with every tensor on ``device`` (a copy per step, small)."""
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return AttentionMetadata(
            slot_mapping=mv(self.slot_mapping), num_decodes=self.num_decodes,
            decode_block_tables=mv(self.decode_block_tables), decode_lens=mv(self.decode_lens),
            block_size=self.block_size, max_decode_len=self.max_decode_len,
            prefills=[PrefillSpan(p.q_start, p.q_len, p.ctx_len, mv(p.ctx_slots), p.state_slot, p.blocks)
                      for p in self.prefills],
            decode_state_slots=mv(self.decode_state_slots))

    def decode_slots_and_mask(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L] slots of every decode's context (padded; the last ``window`` positions only, with a
        window) and [B, 1, 1, L] mask, made once per step and window."""
        if window not in self._gathered:
            L = self.max_decode_len or int(self.decode_lens.max())
            lens = self.decode_lens
            lo = torch.zeros_like(lens)
            if window is not None and window < L:
                L, lo = window, (lens - window).clamp(min=0)
            pos = lo[:, None] + torch.arange(L, device=lens.device)[None, :]
            mask = pos < lens[:, None]
            pos = torch.where(mask, pos, lo[:, None])  # padding reads an in-window slot, masked
            rows = torch.arange(lens.shape[0], device=lens.device)[:, None]
            slots = self.decode_block_tables[rows, pos // self.block_size] * self.block_size + pos % self.block_size
            self._gathered[window] = (slots, mask.view(-1, 1, 1, L))
        return self._gathered[window]

    def prefill_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The C prefill kernel's view of the chunks, made once per step: every chunk's slots of
        positions [0, ctx_len + q_len), concatenated, and [n, 4] int64 rows (first packed row,
        q_len, ctx_len, offset of its slots)."""
        if self._spans is None:
            parts, rows, offset = [], [], 0
            for p in self.prefills:
                own = self.slot_mapping[p.q_start:p.q_start + p.q_len]
                parts.append(own if p.ctx_len == 0 else p.ctx_slots)
                rows.append((p.q_start, p.q_len, p.ctx_len, offset))
                offset += p.ctx_len + p.q_len
            self._spans = (torch.cat(parts).to(torch.int64).contiguous(), torch.tensor(rows, dtype=torch.int64))
        return self._spans


def window_start(ctx_len: int, window: int | None) -> int:
    """The first position any query of a chunk after ``ctx_len`` cached tokens can see."""
    return 0 if window is None else max(0, ctx_len - window + 1)


def _prefill_keys_and_mask(p: PrefillSpan, window: int | None, device: torch.device
                           ) -> tuple[int, torch.Tensor | None]:
    """(first context position gathered, mask over the gathered keys) of a prefill chunk's queries;
    no mask for a first chunk without a window (SDPA's own causal mask serves it). A query in one
    of ``p.blocks`` also sees that block's later keys; the window still bounds every query's
    earliest key (transformers' Gemma 3: sliding AND (causal OR same image))."""
    if window is None and p.ctx_len == 0 and not p.blocks:
        return 0, None
    start = window_start(p.ctx_len, window)
    q_pos = torch.arange(p.ctx_len, p.ctx_len + p.q_len, device=device)[:, None]
    k_pos = torch.arange(start, p.ctx_len + p.q_len, device=device)[None, :]
    seen = k_pos <= q_pos
    for a, b in p.blocks:
        seen = seen | ((q_pos >= a) & (q_pos < b) & (k_pos >= a) & (k_pos < b))
    return start, seen if window is None else seen & (k_pos > q_pos - window)


# Scores the sink path holds at once (float32): its queries go in groups of rows under this.
SINK_SCORES = 1 << 24


def attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax takes each query head's sink logit as one more column, in
    transformers' gpt-oss eager form: [scores, sink] less their max, softmaxed, the sink's column
    dropped. q [N, Hq, Lq, D]; k, v [N, Hkv, L, D] (query head h reads KV head h // (Hq / Hkv));
    mask broadcast to [N, Hq, Lq, L], True where a key is seen (None: all); sinks [Hq]."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1).transpose(-1, -2)
    vf = v.float().repeat_interleave(group, dim=1)
    sink = sinks.float().view(1, -1, 1, 1)
    step = max(1, SINK_SCORES // (q.shape[0] * q.shape[1] * k.shape[2]))  # bounded scores on long prompts
    outs = []
    for r0 in range(0, q.shape[2], step):
        scores = (q[:, :, r0:r0 + step].float() @ kf) * scale
        if mask is not None:
            seen = mask if mask.shape[-2] == 1 else mask[..., r0:r0 + step, :]
            scores = scores.masked_fill(~seen, float("-inf"))
        logits = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        outs.append(probs @ vf)
    return torch.cat(outs, dim=2).to(q.dtype)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, window: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Reference decode path: gather each context (its window) into a padded batch, then SDPA (an
    explicit softmax with sinks: SDPA has no input for them)."""
    slots, mask = meta.decode_slots_and_mask(window)
    kd = from_cache(k_cache[slots], q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
    vd = from_cache(v_cache[slots], q.dtype).transpose(1, 2)
    if sinks is not None:
        return attend_with_sinks(q.unsqueeze(2), kd, vd, mask, scale, sinks).squeeze(2)
    return F.scaled_dot_product_attention(
        q.unsqueeze(2), kd, vd, attn_mask=mask, scale=scale, enable_gqa=True).squeeze(2)


def _sinks_f32(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The sinks as the C kernels read them (float32, contiguous; no copy when they are)."""
    return None if sinks is None else sinks.to(torch.float32).contiguous()


def decode_attention_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, window: int | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Fast decode path: the C kernel reads K/V in place through the block tables (the last
    ``window`` positions of each context, with a window)."""
    lib = load_kernels()
    q = q.contiguous()
    out = torch.empty_like(q)
    B, Hq, D = q.shape
    tables = meta.decode_block_tables
    sinks = _sinks_f32(sinks)
    lib.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        meta.decode_lens.data_ptr(), out.data_ptr(), B, Hq, k_cache.shape[1], D,
        meta.block_size, tables.shape[1], ctypes.c_float(scale), window or 0, KV_KINDS[k_cache.dtype],
        None if sinks is None else sinks.data_ptr())
    return out


def prefill_attention_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             meta: AttentionMetadata, scale: float, window: int | None, out: torch.Tensor,
                             sinks: torch.Tensor | None = None) -> bool:
    """Every prefill chunk's rows of ``out`` by the C kernel, which reads K/V in place through the
    chunks' slots (theirs already written); False when it does not take this head size. Raises
    MemoryError when the kernel cannot allocate its buffers."""
    slots, spans = meta.prefill_slots()
    Hq, D = q.shape[1], q.shape[2]
    sinks = _sinks_f32(sinks)
    served = load_kernels().paged_prefill_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), spans.data_ptr(),
        spans.shape[0], out.data_ptr(), Hq, k_cache.shape[1], D, ctypes.c_float(scale), window or 0,
        KV_KINDS[k_cache.dtype], None if sinks is None else sinks.data_ptr())
    if served < 0:
        raise MemoryError("the prefill attention kernel could not allocate its buffers")
    return bool(served)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, use_kernel: bool = True,
                    window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [slots, Hkv, D]. Returns [T, Hq * D].
    ``window``: the layer's sliding window (None: full causal attention). ``sinks``: [Hq] sink
    logits in every softmax denominator (None: none; module docstring). A cache of another
    dtype than q (``--kv-cache-dtype``) holds K/V rounded to it, and every query reads them so,
    its own chunk's too: results do not depend on how a prompt is chunked (``kv_format``). ``k`` and
    ``v`` None: a layer sharing another's K/V (Gemma 4) writes none and reads that layer's from the
    caches, the step's own rows included."""
    if k is not None:
        k, v = to_cache(k, k_cache), to_cache(v, v_cache)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        decode = decode_attention_kernel if use_kernel else decode_attention_torch
        out[:nd] = decode(q[:nd], k_cache, v_cache, meta, scale, window, sinks)
    kernel_rows = use_kernel and q.stride(2) == 1 and q.stride(1) == q.shape[2] and q.dtype == torch.float32
    kernel_rows = kernel_rows and not any(p.blocks for p in meta.prefills)  # the C kernel is causal only
    if meta.prefills and kernel_rows and prefill_attention_kernel(q, k_cache, v_cache, meta, scale, window, out,
                                                                  sinks):
        return out.view(q.shape[0], -1)
    for p in meta.prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        qp = q[rows].transpose(0, 1).unsqueeze(0)
        start, mask = _prefill_keys_and_mask(p, window, q.device)
        if p.ctx_len == 0 and k is not None:
            kp, vp = k[rows], v[rows]
        else:
            slots = p.ctx_slots if p.ctx_len else meta.slot_mapping[rows]
            kp, vp = k_cache[slots[start:]], v_cache[slots[start:]]
        kp, vp = from_cache(kp, q.dtype), from_cache(vp, q.dtype)  # no copy when the cache is q's dtype
        if sinks is not None:  # SDPA has no sinks: an explicit softmax, causal mask made where SDPA's served
            seen = mask if mask is not None else torch.ones(p.q_len, p.q_len, dtype=torch.bool, device=q.device).tril()
            o = attend_with_sinks(qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0), seen, scale,
                                  sinks)
            out[rows] = o[0].transpose(0, 1)
            continue
        o = F.scaled_dot_product_attention(
            qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=mask is None and p.ctx_len == 0, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out.view(q.shape[0], -1)
