"""The decoder every registered architecture (``ferry.model.arch``) composes, on packed tokens:
Llama's layer, with the options the architectures declare (qkv bias, per-head q/k norms,
per-layer sliding windows, rope scalings).

One forward pass takes every scheduled token of every request as one flat
sequence with no padding. Projections are fused (qkv, gate+up) so each layer is
a few large matrix products; logits are computed only for the rows that sample.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ferry.model.attention import AttentionMetadata, paged_attention
from ferry.model.config import ModelConfig
from ferry.model.fused_decode import FUSED_DECODE_ROWS, FusedDecode
from ferry.model.kernels import kernels_usable, load_kernels
from ferry.model.quant import QuantWeight, RowStack, cat_rows, dequantize, packed, quant_linear
from ferry.model.rope import apply_rope, rope_tables
from ferry.model.row_ops import gated_act_rows, rms_norm_rows, rope_rows_
from ferry.model.tensor_parallel import Collectives, ShardPlan, shard_cols, shard_rows

Weight = torch.Tensor | QuantWeight | RowStack


@dataclass
class ForwardOutput:
    """What a forward pass gives the sampler."""

    logits: torch.Tensor  # float32 [sampling rows, vocab]
    # Scored prompt rows' final normed hidden states, which ``LlamaModel.project`` turns into logits
    # a block at a time; already logits when ``prompt_projected`` (tensor parallelism).
    prompt_rows: torch.Tensor | None = None
    pool_rows: torch.Tensor | None = None  # embedding requests' final normed hidden states
    prompt_projected: bool = False


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [T, top_k] of each token: the softmax's top k, renormalised if ``renorm``."""
    probs = torch.softmax(F.linear(h, router).float(), dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def moe(h: torch.Tensor, layer: LayerWeights, top_k: int, renorm: bool, act: Callable,
        use_kernel: bool = False) -> torch.Tensor:
    """Routed experts: each token's top-k experts, weighted; each expert runs once over all its tokens."""
    weights, chosen = route(h, layer.router, top_k, renorm)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
    tokens = order // top_k
    counts = torch.bincount(flat, minlength=layer.router.shape[0]).tolist()  # one host read per layer
    xs, ys, start = h[tokens], torch.empty_like(h[tokens]), 0
    for e, n in enumerate(counts):
        if n:
            gate, up = linear(xs[start:start + n], layer.experts_gate_up[e], use_kernel=use_kernel).chunk(2, dim=-1)
            ys[start:start + n] = linear(act(gate) * up, layer.experts_down[e], use_kernel=use_kernel)
            start += n
    out = torch.zeros_like(h)
    return out.index_add_(0, tokens, ys * weights.reshape(-1)[order, None].to(h.dtype))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu_tanh": _gelu_tanh}


def _no_tick(part: str) -> None:
    """The profiler's hook when nobody profiles (see ferry.engine.profiler)."""


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight  # [(Hq + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: Weight
    post_norm: torch.Tensor
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight
    q_norm: torch.Tensor | None = None  # [head_dim]: per-head RMS norm of q and k before rope (Qwen3)
    k_norm: torch.Tensor | None = None
    window: int | None = None  # sliding window of this layer's attention (None: full)
    rope: int = 0  # which of the model's rope tables this layer rotates with
    attn_out_norm: torch.Tensor | None = None  # norms on the attention's and the MLP's outputs (Gemma)
    mlp_out_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None  # [experts, hidden]: a mixture-of-experts layer's gate
    experts_gate_up: Sequence[Weight] | None = None  # per expert [2 * moe_intermediate, hidden]
    experts_down: Sequence[Weight] | None = None  # per expert [hidden, moe_intermediate]


# Float32 weights (quantization none): up to KERNEL_ROWS rows the streaming kernel beats BLAS,
# whose packing of the weight costs more than a product this small; from 16 rows torch (oneDNN)
# is faster (`ferry bench kernels`, 2-core AVX-512 CPU). See linear().
KERNEL_ROWS = 8
TRANSPOSED_ROWS = 128


def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T by the C kernel that streams each weight row once (float32)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    load_kernels().skinny_gemm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0], x.shape[1])
    return y


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None,
           use_kernel: bool = False) -> torch.Tensor:
    """x @ w.T (+ bias), by the fastest path for the number of rows.

    Few rows (decode steps): the streaming C kernel. Up to a few hundred: (w @ x.T).T,
    which lets BLAS read the weight in place. Many rows (prefill): plain BLAS.
    Quantized weights: ``quant_linear`` (which picks its own path).
    """
    m = x.shape[0]
    if isinstance(w, (QuantWeight, RowStack)):
        y = quant_linear(x, w)
    elif use_kernel and m <= KERNEL_ROWS:
        y = skinny_linear(x, w)
    elif m <= TRANSPOSED_ROWS:
        y = torch.mm(w, x.t()).t()
    else:
        return F.linear(x, w, bias)
    return y if bias is None else y + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, use_kernel: bool = False) -> torch.Tensor:
    # Hugging Face's LlamaRMSNorm: normalise in float32, cast back, then scale.
    if use_kernel and x.dim() == 2 and x.dtype == torch.float32:
        return rms_norm_rows(x, weight, eps)  # the C rows, one pass each
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _distinct_ropes(cfg: ModelConfig) -> list[tuple[float, Any]]:
    out: list[tuple[float, Any]] = []
    for r in cfg.layer_ropes:
        if r not in out:
            out.append(r)
    return out


def _rope_index(cfg: ModelConfig, layer: int) -> int:
    return _distinct_ropes(cfg).index(cfg.layer_ropes[layer])


class LlamaModel:
    """Weights plus a forward pass over a packed batch; the KV cache is passed in.

    With ``plan`` and ``comm`` (tensor parallelism, ``ferry.model.tensor_parallel``) it holds one
    rank's shard and joins the ranks' partial results with ``comm``; every rank runs ``forward``
    on the same batch and gets the same logits.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, Weight], dtype: torch.dtype,
                 max_len: int, device: torch.device | str = "cpu", plan: ShardPlan | None = None,
                 comm: Collectives | None = None) -> None:
        self.cfg = cfg
        self.plan = plan if plan is not None else ShardPlan.make(cfg, 0, 1)
        self.comm = comm if self.plan.world > 1 else None
        self.dtype = dtype
        self.device = device = torch.device(device)
        # The step profiler (ferry.engine.profiler), when one is on: told the name of each part
        # of the forward pass as it ends.
        self.profiler: Any = None

        def take(name: str) -> Weight:
            if name not in weights:
                raise ValueError(f"checkpoint lacks the weight {name!r}")
            w = weights.pop(name)  # each weight is taken once: the dict lets go as the model takes
            if isinstance(w, QuantWeight):
                if dtype != torch.float32 or device.type != "cpu":
                    raise ValueError("quantized weights run with float32 activations on the CPU: use dtype "
                                     "float32 on the CPU, or quantization 'none'")
                return w
            return w.to(device=device, dtype=dtype).contiguous()

        # This rank's slices (everything, on one rank): rows of the column-parallel weights,
        # columns of the row-parallel ones. Sliced before the cast, so no rank holds it all twice.
        plan, hd = self.plan, cfg.head_dim
        vocab, mlp = plan.vocab, plan.mlp
        heads = {"q": (plan.q_heads[0] * hd, plan.q_heads[1] * hd), "k": (plan.kv_heads[0] * hd, plan.kv_heads[1] * hd)}
        heads["v"] = heads["k"]

        def rows(name: str, span: tuple[int, int]) -> Weight:
            if name in weights and plan.world > 1:
                weights[name] = shard_rows(weights[name], *span)
            return take(name)

        def cols(name: str, span: tuple[int, int]) -> Weight:
            if name in weights and plan.world > 1:
                weights[name] = shard_cols(weights[name], *span)
            return take(name)

        def dense(w: Weight) -> torch.Tensor:
            return dequantize(w) if isinstance(w, QuantWeight) else w

        def norm(name: str) -> torch.Tensor:  # Gemma's (1 + w) folded into the weight once
            w = take(name)
            return w + cfg.norm_offset if cfg.norm_offset else w

        tied = cfg.tie_word_embeddings or "lm_head.weight" not in weights
        # Packed for the LM head's products when tied; lookups gather their rows from the records.
        self.embed = rows("model.embed_tokens.weight", vocab)
        self.embed = packed(self.embed) if tied else self.embed
        self.lm_head = self.embed if tied else packed(rows("lm_head.weight", vocab))
        self.norm = norm("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if cfg.qkv_bias:
                bias = torch.cat([rows(a + f"{x}_proj.bias", heads[x]) for x in "qkv"])
            moe_layer = cfg.moe_layers[i]
            gemma = cfg.sandwich_norms
            m = p + "mlp."
            self.layers.append(LayerWeights(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=packed(cat_rows([rows(a + f"{x}_proj.weight", heads[x]) for x in "qkv"])),
                qkv_bias=bias,
                o_proj=packed(cols(a + "o_proj.weight", heads["q"])),
                post_norm=norm(p + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight")),
                gate_up=None if moe_layer else packed(cat_rows([rows(m + "gate_proj.weight", mlp),
                                                                rows(m + "up_proj.weight", mlp)])),
                down=None if moe_layer else packed(cols(m + "down_proj.weight", mlp)),
                q_norm=norm(a + "q_norm.weight") if cfg.qk_norm else None,
                k_norm=norm(a + "k_norm.weight") if cfg.qk_norm else None,
                window=cfg.layer_windows[i],
                rope=_rope_index(cfg, i),
                attn_out_norm=norm(p + "post_attention_layernorm.weight") if gemma else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if gemma else None,
                router=dense(take(m + "gate.weight")) if moe_layer else None,
                # Kept quantized where the file is (a GGUF's experts): each goes through linear().
                experts_gate_up=[packed(cat_rows([rows(f"{m}experts.{e}.gate_proj.weight", plan.experts),
                                                  rows(f"{m}experts.{e}.up_proj.weight", plan.experts)]))
                                 for e in range(cfg.num_experts)] if moe_layer else None,
                experts_down=[packed(cols(f"{m}experts.{e}.down_proj.weight", plan.experts))
                              for e in range(cfg.num_experts)] if moe_layer else None,
            ))
        # One table per distinct (theta, scaling) among the layers (Gemma: its local and global bases).
        self.ropes = []
        for theta, scaling in _distinct_ropes(cfg):
            cos, sin = rope_tables(cfg.head_dim, theta, scaling, cfg.max_position_embeddings, max_len)
            self.ropes.append((cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)))
        self.cos, self.sin = self.ropes[0]
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.num_heads, self.num_kv_heads = plan.num_heads, plan.num_kv_heads
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        self.use_kernel = device.type == "cpu" and kernels_usable(dtype)  # the C kernels are CPU code
        # The kernels take any K (quantized weights come in whole blocks) and any head size; a
        # tensor-parallel rank runs each layer's halves in C with its all-reduces between them.
        # Architectures whose layers have more than the C decode computes (experts) decode through torch.
        self.fused = FusedDecode(cfg, self.layers, self.scale, self.ropes, (self.num_heads, self.num_kv_heads),
                                 self.comm) if self.use_kernel and cfg.fused_decode else None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor,
                prompt_indices: torch.Tensor | None = None, pool_indices: torch.Tensor | None = None
                ) -> ForwardOutput:
        """Packed tokens in; out, float32 logits for the rows in ``logits_indices`` and the final
        normed hidden states of the rows in ``prompt_indices`` and ``pool_indices``."""
        cfg = self.cfg
        T = input_ids.shape[0]
        hd, hq, hkv = cfg.head_dim, self.num_heads, self.num_kv_heads
        kern, prof, comm = self.use_kernel, self.profiler, self.comm
        tick = _no_tick if prof is None else prof.tick
        x = self._embed(input_ids)
        tick("embed")
        if self.fused is not None and kern and meta.num_decodes == T <= FUSED_DECODE_ROWS:
            self.fused.run(x, positions, meta, kv_caches, self.cos, self.sin, prof)
            return self._outputs(x, logits_indices, prompt_indices, pool_indices, tick)
        eps = cfg.rms_norm_eps
        # Where the kernels run (float32 on the CPU) norm, rope and the activation are C row
        # operations (ferry.model.row_ops); torch's stay the reference.
        rotations = None if kern else [(c[positions].unsqueeze(1), s[positions].unsqueeze(1)) for c, s in self.ropes]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = rms_norm(x, layer.input_norm, eps, kern)
            tick("norm")
            qkv = linear(h, layer.qkv, layer.qkv_bias, use_kernel=kern)
            qkv = qkv.contiguous() if kern else qkv  # rows for the C rope (a transposed product's are not)
            tick("qkv")
            # q and k sit side by side in qkv: rotate them in one pass.
            qk = qkv[:, :self.q_size + self.kv_size].view(T, hq + hkv, hd)
            if layer.q_norm is not None:
                qk = torch.cat([rms_norm(qk[:, :hq], layer.q_norm, cfg.rms_norm_eps),
                                rms_norm(qk[:, hq:], layer.k_norm, cfg.rms_norm_eps)], dim=1)
            if kern:  # in place: on qkv's rows, or on the normed copy's
                rope_rows_(qkv if layer.q_norm is None else qk.view(T, -1), hq + hkv, hd, *self.ropes[layer.rope],
                           positions)
            else:
                qk = apply_rope(qk, *rotations[layer.rope])
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, self.q_size + self.kv_size:].view(T, hkv, hd)
            tick("rope")
            o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, use_kernel=kern, window=layer.window)
            tick("attention")
            o = linear(o, layer.o_proj, use_kernel=kern)
            o = o if comm is None else comm.all_reduce(o)
            x = x + (o if layer.attn_out_norm is None else rms_norm(o, layer.attn_out_norm, eps, kern))
            tick("o_proj")
            h = rms_norm(x, layer.post_norm, eps, kern)
            tick("norm")
            if layer.router is not None:
                h = moe(h, layer, cfg.experts_per_token, cfg.norm_topk_prob, self.act, kern)
                h = h if comm is None else comm.all_reduce(h)  # each rank ran its slice of every expert
                tick("experts")
            else:
                gate_up = linear(h, layer.gate_up, use_kernel=kern)
                tick("gate_up")
                if kern:
                    h = gated_act_rows(gate_up, self.cfg.hidden_act == "gelu_tanh")
                else:
                    gate, up = gate_up.chunk(2, dim=-1)
                    h = self.act(gate) * up
                tick("act")
                h = linear(h, layer.down, use_kernel=kern)
                h = h if comm is None else comm.all_reduce(h)
            x = x + (h if layer.mlp_out_norm is None else rms_norm(h, layer.mlp_out_norm, eps, kern))
            tick("down")
        return self._outputs(x, logits_indices, prompt_indices, pool_indices, tick)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self._lookup(input_ids)
        # Gemma scales by sqrt(hidden) rounded to the weights' dtype, as Hugging Face does.
        return x if self.cfg.embed_scale == 1.0 else x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return dequantize(self.embed, input_ids) if isinstance(self.embed, QuantWeight) else self.embed[input_ids]
        # Vocab-parallel: each rank looks up the ids in its slice, zeros elsewhere; the sum is the lookup.
        lo, hi = self.plan.vocab
        mine = (input_ids >= lo) & (input_ids < hi)
        local = torch.where(mine, input_ids - lo, 0)
        x = dequantize(self.embed, local) if isinstance(self.embed, QuantWeight) else self.embed[local]
        return self.comm.all_reduce(x * mine.unsqueeze(1).to(x.dtype))

    def _outputs(self, x: torch.Tensor, rows: torch.Tensor, prompt_rows: torch.Tensor | None,
                 pool_rows: torch.Tensor | None, tick: Callable[[str], None]) -> ForwardOutput:
        def normed(idx: torch.Tensor | None) -> torch.Tensor | None:
            return rms_norm(x[idx], self.norm, self.cfg.rms_norm_eps) if idx is not None and idx.numel() else None

        logits = self.project(rms_norm(x[rows], self.norm, self.cfg.rms_norm_eps))
        out = ForwardOutput(logits, normed(prompt_rows), normed(pool_rows))
        if self.comm is not None and out.prompt_rows is not None:
            out.prompt_rows = self.project(out.prompt_rows)  # a collective of all ranks: now, on each
            out.prompt_projected = True
        tick("lm_head")
        return out

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final normed hidden states (the LM head, with any final soft-cap)."""
        # Contiguous: sampling reads rows, and a transposed product's rows are strided.
        logits = linear(h, self.lm_head, use_kernel=self.use_kernel).float().contiguous()
        if self.comm is not None:
            logits = self.comm.all_gather_vocab(logits)
        if self.cfg.final_logit_softcap:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
