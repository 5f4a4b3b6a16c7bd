"""The decoder every registered architecture (``ferry.model.arch``) is: an embedding, layers built
from the parts its declaration names (``ferry.model.layers``), a final norm and the LM head, on
packed tokens.

One forward pass takes every scheduled token of every request as one flat sequence with no
padding. Each layer is residual blocks, x += out_norm(part(norm(x))); projections are fused (qkv,
gate+up) so a part is a few large matrix products; logits are computed only for the rows that
sample. A decode-only step of few rows runs every layer as one C call (``ferry.model.fused_decode``)
when every part has its ops there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ferry.model.attention import AttentionMetadata
from ferry.model.config import ModelConfig
from ferry.model.fused_decode import FUSED_DECODE_ROWS, FusedDecode, NotFused, Op, Segment
from ferry.model.kernels import kernels_usable
from ferry.model.layers import PARTS
from ferry.model.layers.context import StepContext
from ferry.model.layers.gemma4 import PerLayerInput, PerLayerInputs
from ferry.model.layers.linear import Weight, linear
from ferry.model.layers.norm import rms_norm
from ferry.model.layers.rope import rope_tables
from ferry.model.multimodal import ImageRows
from ferry.model.quant import QuantWeight, dequantize, packed
from ferry.model.tensor_parallel import Collectives, ShardPlan
from ferry.model.weights import WeightTaker


@dataclass
class ForwardOutput:
    """What a forward pass gives the sampler."""

    logits: torch.Tensor  # float32 [sampling rows, vocab]
    # Scored prompt rows' final normed hidden states, which ``DecoderModel.project`` turns into logits
    # a block at a time; already logits when ``prompt_projected`` (tensor parallelism).
    prompt_rows: torch.Tensor | None = None
    pool_rows: torch.Tensor | None = None  # embedding requests' final normed hidden states
    prompt_projected: bool = False
    hidden: torch.Tensor | None = None  # the sampling rows' final normed hidden states (an MTP head reads them)
    all_hidden: torch.Tensor | None = None  # every row's, when the model's ``keep_hidden`` is set


def _no_tick(part: str) -> None:
    """The step timer's hook when nobody profiles (``ferry.executor.base.StepTimer``)."""


@dataclass
class Residual:
    """x += out_norm(part(norm(x))), the part's output all-reduced first under tensor parallelism."""

    norm: torch.Tensor | None  # None: the part reads x itself (Gemma 4's per-layer input block)
    part: Any
    out_norm: torch.Tensor | None = None
    scale: float = 1.0  # the output's scale before the add (Granite's residual multiplier)

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: Any) -> torch.Tensor:
        h = x if self.norm is None else rms_norm(x, self.norm, ctx.eps, ctx.use_kernel)
        ctx.tick("norm")
        o = self.part.forward(h, ctx, cache)
        o = o if ctx.comm is None else ctx.comm.all_reduce(o)
        o = o if self.out_norm is None else rms_norm(o, self.out_norm, ctx.eps, ctx.use_kernel)
        x = x + (o if self.scale == 1.0 else o * self.scale)
        ctx.tick(self.part.end)
        return x

    def segment(self, ctx: StepContext, cache: Any) -> Segment:
        """Its ops for the fused decode, the part's output left in "out" (a part with no norm before
        it reads "x")."""
        norm = [] if self.norm is None else [Op("norm", "x", "h", "norm", w=self.norm)]
        return Segment(norm + self.part.ops(ctx, cache), self.out_norm, self.scale)


@dataclass
class DecoderLayer:
    blocks: list[Residual]  # the mixer's, then the MLP's
    extra: list[Residual] = field(default_factory=list)  # after them (Gemma 4's per-layer input block)
    scalar: torch.Tensor | None = None  # the layer's output times this (Gemma 4's layer_scalar)

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: Any) -> torch.Tensor:
        for block in self.blocks + self.extra:
            x = block.forward(x, ctx, cache)
        return x if self.scalar is None else x * self.scalar

    def segments(self, ctx: StepContext, cache: Any) -> list[Segment]:
        """Its blocks' ops for the fused decode (the scalar after the last block's add, on one rank)."""
        if self.scalar is not None and ctx.comm is not None:
            raise NotFused("a layer scalar under tensor parallelism (the caller's residual adds)")
        segments = [block.segment(ctx, cache) for block in self.blocks + self.extra]
        if self.scalar is not None:
            segments[-1].post.append(Op("scale", "x", "x", self.blocks[-1].part.end, scale=float(self.scalar)))
        return segments

    @property
    def mixer(self) -> Any:
        return self.blocks[0].part

    @property
    def mlp(self) -> Any:
        return self.blocks[-1].part


@dataclass
class PartFacts:
    """What a part's build reads about the model beyond its own weights."""

    heads: tuple[int, int, int]  # this rank's (query heads, KV heads, head size)
    rope_index: Callable[[Any], int]  # an AttentionSpec -> the index of its rope table


class DecoderModel:
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
        # The step timer (``ferry.executor.base.StepTimer``), when one is on: told the name of each
        # part of the forward pass as it ends.
        self.profiler: Any = None
        self.keep_hidden = False  # every row's final normed hidden state in the output (an MTP head's input)
        take = WeightTaker(cfg, weights, self.plan, dtype, device)
        tied = cfg.tie_word_embeddings or not take.has("lm_head.weight")
        # Packed for the LM head's products when tied; lookups gather their rows from the records.
        self.embed = take.model_tensor("embed")
        self.embed = packed(self.embed) if tied else self.embed
        self.lm_head = self.embed if tied else packed(take.model_tensor("lm_head"))
        self.norm = take.model_tensor("final_norm")
        # One rope table per distinct (theta, scaling) among the layers (Gemma: its local and global bases).
        # (Qwen3.5: a rotation of the first quarter of each head only: its own table's width.)
        distinct: list[tuple[float, Any, int]] = []
        for layer in cfg.layers:
            a = layer.attention
            key = a and (*a.rope, a.rotary_dim or cfg.head_dim)
            if a is not None and key not in distinct:
                distinct.append(key)
        self.ropes = []
        for theta, scaling, dim in distinct:
            cos, sin = rope_tables(dim, theta, scaling, cfg.max_position_embeddings, max_len)
            self.ropes.append((cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)))
        self.num_heads, self.num_kv_heads = self.plan.num_heads, self.plan.num_kv_heads
        facts = PartFacts((self.num_heads, self.num_kv_heads, cfg.head_dim),
                          lambda spec: distinct.index((*spec.rope, spec.rotary_dim or cfg.head_dim)))
        self.layers = [self._layer(take.layer(i), facts, i) for i in range(cfg.num_layers)]
        self.per_layer = None  # Gemma 4's per-layer input embeddings
        if cfg.per_layer_input:
            self.per_layer = PerLayerInputs(take.model_tensor("ple_embed"), packed(take.model_tensor("ple_model_proj")),
                                            take.model_tensor("ple_model_norm"), cfg.num_layers, cfg.per_layer_input)
        # The fused decode's per-layer inputs: its ops point here; each fused step fills its rows first.
        self.per_layer_rows = None if self.per_layer is None else \
            torch.zeros(FUSED_DECODE_ROWS, cfg.num_layers, cfg.per_layer_input, dtype=dtype, device=device)
        self.use_kernel = device.type == "cpu" and kernels_usable(dtype)  # the C kernels are CPU code
        # The kernels take any K (quantized weights come in whole blocks) and any head size; a
        # tensor-parallel rank runs each residual block's ops in C with its all-reduces between them.
        self.fused = None
        if self.use_kernel and self._compile_ops(None) is not None:
            self.fused = FusedDecode(self._compile_ops, cfg.hidden_size, facts.heads, cfg.rms_norm_eps, self.comm)

    def _layer(self, w: dict[str, Any], facts: PartFacts, index: int) -> DecoderLayer:
        spec, blocks, scale = w["spec"], [], self.cfg.residual_scale
        if spec.mixer is not None:
            blocks.append(Residual(w["input_norm"], PARTS[spec.mixer.kind](spec.mixer, w, facts), w.get("attn_out_norm"),
                                   scale))
        if spec.mlp is not None:  # a part that norms the residual its own ways reads it unnormed (Gemma 4's experts)
            norm = None if getattr(spec.mlp, "reads_residual", False) else w["mlp_norm"]
            blocks.append(Residual(norm, PARTS[spec.mlp.kind](spec.mlp, w, facts), w.get("mlp_out_norm"), scale))
        extra = [Residual(None, PerLayerInput.build(spec, w, index), w["ple_norm"])] if spec.per_layer_input else []
        return DecoderLayer(blocks, extra, w.get("layer_scalar"))

    def _context(self, positions: torch.Tensor, meta: AttentionMetadata | None, tick: Callable[[str], None]
                 ) -> StepContext:
        return StepContext(positions, meta, self.use_kernel, self.cfg.rms_norm_eps, tick, self.ropes, comm=self.comm)

    def _compile_ops(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None) -> list[Segment] | None:
        """Every block's ops in order (None: some part has no op in the C decode). Without caches it
        only checks that every part has its ops."""
        ctx = self._context(torch.empty(0, dtype=torch.int64), None, _no_tick)
        ctx.per_layer = self.per_layer_rows
        caches = kv_caches or [(torch.empty(0), torch.empty(0))] * len(self.layers)
        try:
            return [seg for layer, cache in zip(self.layers, caches) for seg in layer.segments(ctx, cache)]
        except NotFused:
            return None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor,
                prompt_indices: torch.Tensor | None = None, pool_indices: torch.Tensor | None = None,
                images: ImageRows | None = None, embeds: torch.Tensor | None = None) -> ForwardOutput:
        """Packed tokens in; out, float32 logits for the rows in ``logits_indices`` and the final
        normed hidden states of the rows in ``prompt_indices`` and ``pool_indices``. ``images``: the
        step's image rows (their embeddings, deepstack features and per-axis rope positions). ``embeds``:
        the rows' inputs in place of the token embeddings (an MTP head's projected inputs)."""
        T = input_ids.shape[0]
        prof = self.profiler
        tick = _no_tick if prof is None else prof.tick
        x = self._embed(input_ids) if embeds is None else embeds
        if images is not None:
            x[images.rows] = images.embeds.to(x.dtype)
        tick("embed")
        if self.fused is not None and self.use_kernel and meta.num_decodes == T <= FUSED_DECODE_ROWS \
                and images is None:
            if self.per_layer is not None:
                self.per_layer_rows[:T] = self.per_layer(input_ids, x, self.cfg.rms_norm_eps, self.use_kernel)
            self.fused.run(x, positions, meta, kv_caches, prof)
            return self._outputs(x, logits_indices, prompt_indices, pool_indices, tick)
        ctx = self._context(positions, meta, tick)
        if images is not None:  # multimodal rope: each row's own table row, at its row index
            ctx.ropes = images.row_tables(self.ropes)
            ctx.positions = positions = torch.arange(T, device=positions.device)
        # Where the kernels run (float32 on the CPU) norm, rope and the activation are C row
        # operations (ferry.model.row_ops); torch's stay the reference.
        if not self.use_kernel:
            ctx.rotations = [(c[positions].unsqueeze(1), s[positions].unsqueeze(1)) for c, s in ctx.ropes]
        if self.per_layer is not None:
            ctx.per_layer = self.per_layer(input_ids, x, self.cfg.rms_norm_eps, self.use_kernel)
        deepstack = images.deepstack if images is not None else ()
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer.forward(x, ctx, cache)
            if i < len(deepstack):  # Qwen3-VL: vision features join the first layers' image rows
                x[images.rows] += deepstack[i].to(x.dtype)
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

        hidden = rms_norm(x[rows], self.norm, self.cfg.rms_norm_eps)
        out = ForwardOutput(self.project(hidden), normed(prompt_rows), normed(pool_rows), hidden=hidden)
        if self.keep_hidden:
            out.all_hidden = rms_norm(x, self.norm, self.cfg.rms_norm_eps)
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
        if self.cfg.logits_divisor != 1.0:
            logits = logits / self.cfg.logits_divisor
        if self.cfg.final_logit_softcap:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
