"""How long one step takes, from its composition: a roofline per part of the model.

A step is the scheduler's ``{request_id: num_tokens}`` plus each chunk's start
(the context already in the KV cache). With T tokens in the step, S of them
sampling, and per chunk n new tokens after ``start`` cached ones:

    linear    = roof(2 * P_lin * T / F,  P_lin * b / B)         P_lin: params of the layers' matrices
    attention = roof(sum 4 * L * H * d * n * (start + (n + 1) / 2) / F_attn,
                     sum 2 * L * H_kv * d * b * (start + n) / B)  (K and V read for every chunk)
    lm head   = roof(2 * h * V * S / F,  h * V * b / B)          only rows that sample
    gather    = sum over prefill chunks (n > 1) of 2 * L * H_kv * d * b * start / G
    comm      = 2 * L * (latency + 2 * (tp - 1) / tp * T * h * b / link)   with tensor parallelism
    time      = overhead + per_request * R + per_prefill_chunk * R_prefill
                + linear + attention + lm head + gather + comm

roof(c, m) = max(c, m) + (1 - overlap) * min(c, m): the roofline when compute and memory
traffic overlap (overlap = 1, a GPU), their sum when they do not (overlap = 0).
F, F_attn and B are achievable rates (peak x efficiency); b bytes per value. G is the rate at
which an engine copies a prefill chunk's cached context before attending to it (ferry's CPU
path does; GPU kernels read the paged cache in place: no G, no term). R_prefill counts chunks of
more than one token: an engine whose prefill path differs from its decode path (ferry's CPU
engine runs decodes in one fused C call per layer, prefills through torch) pays a fixed cost
for each.
Tensor parallelism divides FLOPs and bytes by tp. See docs/scheduling.md for the limits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ferry.model.config import ModelConfig
from ferry.model.shard_plan import ShardPlan
from ferry.sim.hardware import Hardware


@dataclass(frozen=True)
class StepTerms:
    """The quantities a step's time is made of (before dividing by rates)."""

    linear_flops: float
    weight_bytes: float
    attn_flops: float
    kv_bytes: float
    head_flops: float
    head_bytes: float
    gather_bytes: float  # cached context of prefill chunks that follow earlier chunks
    num_tokens: int
    num_requests: int
    num_prefill_chunks: int = 0


class CostModel:
    def __init__(self, model: ModelConfig, hw: Hardware, tp: int = 1) -> None:
        # The real engine's sharding decides what splits (heads by KV group, unevenly if need be);
        # the cost divides evenly by tp, so an uneven split's largest rank is a little slower than this.
        ShardPlan.make(model, 0, tp)
        if tp > 1 and hw.interconnect_gbs <= 0:
            raise ValueError(f"hardware {hw.name!r} has no interconnect_gbs: cannot model tensor parallelism "
                             f"(give the profile the link's GB/s and allreduce_latency_us)")
        self.model, self.hw, self.tp = model, hw, tp
        m, b = model, hw.dtype_bytes
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        self.linear_params = m.num_layers * (m.hidden_size * (q + 2 * kv) + q * m.hidden_size
                                             + 3 * m.hidden_size * m.intermediate_size)
        self.head_params = m.hidden_size * m.vocab_size
        embed = 0 if m.tie_word_embeddings else m.hidden_size * m.vocab_size
        self.weight_bytes_total = (self.linear_params + self.head_params + embed) * b
        self.kv_bytes_per_token = 2 * m.num_layers * kv * b  # all devices together
        self._attn_flops_per = 4 * m.num_layers * q  # x n * (start + (n + 1) / 2)

    def terms(self, chunks: Iterable[tuple[int, int]], num_sampling: int) -> StepTerms:
        """``chunks``: (num_tokens, start) per request in the step."""
        tokens = requests = prefills = 0
        attn = ctx = gather = 0.0
        for n, start in chunks:
            tokens += n
            requests += 1
            attn += n * (start + (n + 1) / 2)
            ctx += start + n
            if n > 1:
                gather += start
                prefills += 1
        tp, b = self.tp, self.hw.dtype_bytes
        return StepTerms(
            linear_flops=2 * self.linear_params * tokens / tp,
            weight_bytes=self.linear_params * b / tp,
            attn_flops=self._attn_flops_per * attn / tp,
            kv_bytes=self.kv_bytes_per_token * ctx / tp,
            head_flops=2 * self.head_params * num_sampling / tp,
            head_bytes=self.head_params * b / tp if num_sampling else 0.0,
            gather_bytes=self.kv_bytes_per_token * gather / tp, num_tokens=tokens, num_requests=requests,
            num_prefill_chunks=prefills)

    def time(self, t: StepTerms) -> float:
        hw = self.hw
        f, fa, bw = hw.flops, hw.attn_flops, hw.bandwidth
        sec = 1e-3 * (hw.step_overhead_ms + hw.per_request_overhead_ms * t.num_requests
                      + hw.per_prefill_chunk_ms * t.num_prefill_chunks)
        ov = hw.overlap

        def roof(c: float, m: float) -> float:
            return max(c, m) + (1.0 - ov) * min(c, m)

        sec += roof(t.linear_flops / f, t.weight_bytes / bw)
        sec += roof(t.attn_flops / fa, t.kv_bytes / bw)
        sec += roof(t.head_flops / f, t.head_bytes / bw)
        if hw.context_gather_gbs:
            sec += t.gather_bytes / (hw.context_gather_gbs * 1e9)
        if self.tp > 1:
            link = hw.interconnect_gbs * 1e9
            msg = t.num_tokens * self.model.hidden_size * hw.dtype_bytes
            sec += 2 * self.model.num_layers * (hw.allreduce_latency_us * 1e-6
                                                + 2 * (self.tp - 1) / self.tp * msg / link)
        return sec

    def step_time(self, chunks: Iterable[tuple[int, int]], num_sampling: int) -> float:
        """Seconds for one step of these (num_tokens, start) chunks."""
        return self.time(self.terms(chunks, num_sampling))
