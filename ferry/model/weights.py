"""Weights by declaration: every tensor an architecture declares (``ferry.model.arch.parts``),
read from a checkpoint's dict, cut for this tensor-parallel rank, cast, and fused into the products
the decoder runs; random ones of the same shapes for ``load_format="dummy"``."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ferry.model.arch.parts import LayerSpec, TensorDecl, model_tensors, per_layer_tensors
from ferry.model.config import ModelConfig
from ferry.model.quant import QuantWeight, RowStack, cat_rows, dequantize
from ferry.model.shard_plan import ShardPlan
from ferry.model.tensor_parallel import shard_cols, shard_rows

Weight = torch.Tensor | QuantWeight | RowStack

# The residual blocks' norms: random weights start them below 1 + w's identity (the others at 1).
BLOCK_NORMS = ("input_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm")


def layer_tensors(cfg: ModelConfig, layer: int) -> list[TensorDecl]:
    """Layer ``layer``'s declared tensors, in declaration order."""
    return cfg.layers[layer].tensors(cfg)


def declared(cfg: ModelConfig) -> Iterator[tuple[str, TensorDecl]]:
    """(Hugging Face name, declaration) of every tensor the model holds (one per expert)."""
    names = cfg.arch.name_table()
    tied = cfg.tie_word_embeddings
    for d in model_tensors(cfg.hidden_size, cfg.vocab_size, tied) + per_layer_tensors(cfg):
        yield f"{names[d.role][0]}.{d.suffix}", d
    for i in range(cfg.num_layers):
        decls = layer_tensors(cfg, i)
        plain = [d for d in decls if not d.experts]
        named = [_name(names, i, d, prefix=cfg.arch.layer_prefix) for d in plain]
        if len(set(named)) < len(named):
            twice = sorted({n for n in named if named.count(n) > 1})
            raise ValueError(f"{cfg.architecture} declares two tensors named {', '.join(twice)}: rename a role")
        yield from zip(named, plain)
        by_expert = [d for d in decls if d.experts]
        for e in range(by_expert[0].experts if by_expert else 0):
            for d in by_expert:
                yield _name(names, i, d, e, cfg.arch.layer_prefix), d


def _name(names: dict[str, tuple[str, str]], layer: int, d: TensorDecl, expert: int | None = None,
          prefix: str = "model.layers") -> str:
    hf = names[d.role][0]
    hf = hf.format(e=expert) if expert is not None else hf
    return f"{prefix}.{layer}.{hf}.{d.suffix}" if hf else f"{prefix}.{layer}.{d.suffix}"  # "": the layer's own


def dummy_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the declared shapes, for benchmarking sizes we cannot download."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, d in declared(cfg):
        if d.norm:
            out[name] = torch.ones(*d.shape) - (cfg.arch.norm_offset * 0.5 if d.role in BLOCK_NORMS else 0.0)
        else:
            out[name] = torch.randn(*d.shape, generator=g) * 0.02
    return out


def unfuse(weights: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Split the checkpoint tensors an architecture stores fused (Phi-3's qkv_proj, gate_up_proj)
    into its roles' tensors, by rows: the decoder fuses them again after any tensor-parallel cut
    (and first the architecture's own renaming of its checkpoint, ``checkpoint_tensors``)."""
    if cfg.arch.checkpoint_tensors is not None:
        weights = cfg.arch.checkpoint_tensors(weights)
    fused = cfg.arch.checkpoint_fused
    if not fused:
        return weights
    names = cfg.arch.name_table()
    for n in range(cfg.num_layers):
        shapes = {d.role: d.shape[0] for d in layer_tensors(cfg, n) if d.suffix == "weight"}
        for src, (_, roles) in fused.items():
            name = f"model.layers.{n}.{src}.weight"
            if name not in weights:
                continue
            w, start = weights.pop(name), 0
            for role in roles:  # rows: a quantized tensor's rows of blocks too
                size = shapes[role]
                weights[f"model.layers.{n}.{names[role][0]}.weight"] = shard_rows(w, start, start + size)
                start += size
    return weights


class WeightTaker:
    """Takes the declared tensors out of a checkpoint's dict (letting go as it goes), cut for this
    rank, cast to the model's dtype and device, norms offset, fused products stacked."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Weight], plan: ShardPlan, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cfg, self.weights, self.plan, self.dtype, self.device = cfg, weights, plan, dtype, device
        self.names = cfg.arch.name_table()
        self.prefix = cfg.arch.layer_prefix
        hd = cfg.head_dim
        self.spans = {"q": (plan.q_heads[0] * hd, plan.q_heads[1] * hd),
                      "kv": (plan.kv_heads[0] * hd, plan.kv_heads[1] * hd),
                      "mlp": plan.mlp, "experts": plan.experts, "vocab": plan.vocab, "heads": plan.q_heads}

    def has(self, name: str) -> bool:
        return name in self.weights

    def take(self, name: str, d: TensorDecl) -> Weight:
        """One tensor: cut (before the cast, so no rank holds it all twice), cast, offset."""
        w = self.weights.pop(name, None)  # each weight is taken once: the dict lets go as the model takes
        if w is None:
            raise ValueError(f"checkpoint lacks the weight {name!r}")
        if d.cut != "rows:vocab" and tuple(w.shape) != d.shape:  # a vocabulary may be padded past the config's
            raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, the config says {d.shape}")
        if d.cut and self.plan.world > 1:
            how, span = d.cut.split(":")
            w = (shard_rows if how == "rows" else shard_cols)(w, *self.spans[span])
        if isinstance(w, QuantWeight):
            if d.dense:
                w = dequantize(w)
            else:
                if self.dtype != torch.float32 or self.device.type != "cpu":
                    raise ValueError("quantized weights run with float32 activations on the CPU: use dtype "
                                     "float32 on the CPU, or quantization 'none'")
                return w
        w = w.to(device=self.device, dtype=self.dtype).contiguous()
        offset = self.cfg.arch.norm_offset
        return w + offset if d.norm and offset else w  # Gemma's (1 + w) folded into the weight once

    def model_tensor(self, role: str) -> Weight:
        decls = model_tensors(self.cfg.hidden_size, self.cfg.vocab_size, False) + per_layer_tensors(self.cfg)
        d = next(d for d in decls if d.role == role)
        return self.take(f"{self.names[role][0]}.{d.suffix}", d)

    def layer(self, i: int) -> dict[str, Any]:
        """Layer ``i``'s weights by role, fused products by their fused name ("qkv", "gate_up",
        "qkv_bias"); experts' as lists, one entry per expert."""
        spec: LayerSpec = self.cfg.layers[i]
        groups: dict[str, list[Weight]] = {}
        out: dict[str, Any] = {}
        for d in layer_tensors(self.cfg, i):
            if d.experts:
                ws = [self.take(_name(self.names, i, d, e, self.prefix), d) for e in range(d.experts)]
                key = f"expert_{d.fuse}" if d.fuse else d.role
                if d.fuse:
                    groups.setdefault(key, []).append(ws)
                else:
                    out[key] = ws
                continue
            w = self.take(_name(self.names, i, d, prefix=self.prefix), d)
            if d.fuse:
                groups.setdefault(d.fuse, []).append(w)
            else:
                out[d.role] = w
        for key, ws in groups.items():
            if key.startswith("expert_"):  # per expert: its parts' rows stacked
                out[key] = [cat_rows(list(parts)) for parts in zip(*ws)]
            elif key.endswith("_bias"):
                out[key] = torch.cat(ws)
            else:
                out[key] = cat_rows(ws)
        out["spec"] = spec
        return out
