"""Gemma 4's assistant drafter (transformers' ``Gemma4AssistantForCausalLM``, model type
``gemma4_assistant``) as the drafter of speculative method ``mtp`` for a Gemma 4 target.

It has no K/V of its own: each of its layers attends to the target's K/V, its sliding layers to the
target's last sliding layer that keeps K/V, its global layers to the target's last global one. For
a request whose last known token ``t`` sits at position ``q``, a draft step takes the target's final
normed hidden state ``h`` of position ``q - 1`` (or the previous step's projected state)::

    x = pre_projection(concat(target_embedding(t), h))        # [2 * backbone] -> [hidden]
    x = layers(x)             # Gemma 4 text layers at position q, over the target's K/V before q
    y = norm(x)
    logits = lm_head(y)       # or the centroid-masked lm_head (use_ordered_embeddings)
    h' = post_projection(y)   # [hidden] -> [backbone]: the next step's h

Every step of a draft runs at the same position ``q`` over the same K/V (transformers'
``Gemma4AssistantCandidateGenerator``): the global layers see positions ``0 .. q - 1``, the sliding
ones the last ``window + 1`` of them (its bidirectional window mask, flipped to look back).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ferry.executor.mtp import MTPProposer
from ferry.model.arch.parts import hidden_act
from ferry.model.config import ModelConfig, rope_scaling
from ferry.model.kv_format import dequantize_q8_0
from ferry.model.layers.mlp import ACTIVATIONS
from ferry.model.layers.norm import rms_norm
from ferry.model.layers.rope import apply_rope, rope_tables

ASSISTANT_TYPES = {"Gemma4AssistantForCausalLM": "gemma4_assistant"}
TARGET_ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
SLIDING, FULL = "sliding_attention", "full_attention"


def assistant_config(model: str | Path | None) -> dict[str, Any] | None:
    """The config.json of ``model`` when it is a Gemma 4 assistant drafter, else None (a
    ValueError for the unified assistant, which ferry does not run)."""
    if model is None:
        return None
    path = Path(model).expanduser() / "config.json"
    try:
        d = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return None
    if "Gemma4UnifiedAssistantForCausalLM" in (d.get("architectures") or []) or \
            d.get("model_type") == "gemma4_unified_assistant":
        raise ValueError(f"speculative_config.model {str(model)!r} is a Gemma 4 unified assistant drafter, which "
                         "ferry does not run (it runs gemma4_assistant)")
    if set(ASSISTANT_TYPES) & set(d.get("architectures") or []) or d.get("model_type") in ASSISTANT_TYPES.values():
        return d
    return None


@dataclass
class _Layer:
    kind: str  # SLIDING or FULL: which of the target's K/V it reads and which rope it rotates with
    q: torch.Tensor
    q_norm: torch.Tensor
    o: torch.Tensor
    norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # input, post-attn, pre-ff, post-ff
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    scalar: torch.Tensor
    head_dim: int


class Gemma4AssistantHead:
    """The assistant's weights and one draft step over the target's K/V rows of one request."""

    def __init__(self, d: dict[str, Any], tensors: dict[str, torch.Tensor], target_cfg: ModelConfig,
                 target: Any, dtype: torch.dtype, max_len: int, device: torch.device) -> None:
        if target_cfg.architecture not in TARGET_ARCHITECTURES:
            raise ValueError(f"speculative_config: a Gemma 4 assistant drafts for a Gemma 4 target, not "
                             f"{target_cfg.architecture}")
        t = d.get("text_config") or {}
        if t.get("hidden_size_per_layer_input") or t.get("enable_moe_block") or t.get("use_double_wide_mlp"):
            raise ValueError("speculative_config.model: a Gemma 4 assistant with per-layer inputs, experts or "
                             "double-wide MLPs is not one transformers defines")
        backbone = int(d.get("backbone_hidden_size", 1536))
        if backbone != target_cfg.hidden_size or t["vocab_size"] != target_cfg.vocab_size:
            raise ValueError(f"speculative_config.model: the assistant was made for a target of hidden size "
                             f"{backbone} and {t['vocab_size']} tokens, this target has {target_cfg.hidden_size} "
                             f"and {target_cfg.vocab_size}")
        self.target, self.target_cfg, self.device, self.dtype = target, target_cfg, device, dtype
        self.eps = float(t.get("rms_norm_eps", 1e-6))
        self.window = t.get("sliding_window")
        self.heads = int(t["num_attention_heads"])
        n = int(t["num_hidden_layers"])
        kinds = list(t.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
        # The target's layers whose K/V the assistant reads: the last of each kind that keeps its own.
        own = target_cfg.kv_cache_layers
        self.sources = {}
        for kind in set(kinds):
            of_kind = [i for i in own if (target_cfg.layers[i].attention.window is not None) == (kind == SLIDING)]
            if not of_kind:
                raise ValueError(f"speculative_config.model: the assistant's {kind} layers read the target's "
                                 f"last such layer, and the target has none keeping K/V")
            self.sources[kind] = of_kind[-1]

        def w(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"speculative_config.model: the assistant's checkpoint lacks {name}")
            return tensors[name].to(device=device, dtype=dtype).contiguous()

        # Head sizes as transformers saves them: per-layer overrides, else the global layers' own size.
        per_layer = {int(k): v for k, v in (t.get("per_layer_config") or {}).items() if str(k).isdigit()}
        head_dims = []
        for i, kind in enumerate(kinds):
            own = per_layer.get(i, {}) if per_layer else \
                ({} if kind == SLIDING else {"head_dim": t.get("global_head_dim", 512)})
            head_dims.append(int(own.get("head_dim", t.get("head_dim", 256))))
        self.layers = []
        for i, kind in enumerate(kinds):
            p = f"model.layers.{i}."
            kv_heads, kv_dim = target_cfg.kv_heads(self.sources[kind])
            if kv_dim != head_dims[i] or self.heads % kv_heads:
                raise ValueError(f"speculative_config.model: assistant layer {i} ({kind}) has head size "
                                 f"{head_dims[i]} and {self.heads} heads; the target's K/V has {kv_heads} heads "
                                 f"of {kv_dim}")
            self.layers.append(_Layer(
                kind, w(p + "self_attn.q_proj.weight"), w(p + "self_attn.q_norm.weight"), w(p + "self_attn.o_proj.weight"),
                tuple(w(p + f"{x}.weight") for x in ("input_layernorm", "post_attention_layernorm",
                                                     "pre_feedforward_layernorm", "post_feedforward_layernorm")),
                w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight"), w(p + "mlp.down_proj.weight"),
                w(p + "layer_scalar") if p + "layer_scalar" in tensors else torch.ones(1, device=device, dtype=dtype),
                head_dims[i]))
        self.act = ACTIVATIONS[hidden_act(t, "the assistant's config.json")]
        self.norm = w("model.norm.weight")
        self.lm_head = w("lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight")
        self.pre = w("pre_projection.weight")
        self.post = w("post_projection.weight")
        self.ordered = bool(d.get("use_ordered_embeddings", False))
        if self.ordered:
            self.centroids = w("masked_embedding.centroids.weight")
            self.ordering = tensors["masked_embedding.token_ordering"].to(device=device, dtype=torch.long)
            self.top_k = int(d.get("centroid_intermediate_top_k", 32))
        rp = t.get("rope_parameters") or {}
        max_pos = int(t.get("max_position_embeddings", max_len))
        self.ropes = {}  # by (kind, head size)
        for kind, hd in set(zip(kinds, head_dims)):
            v = rp.get(kind, {})
            cos, sin = rope_tables(hd, float(v.get("rope_theta", 1e4)),
                                   rope_scaling(v, "the assistant's config.json"), max_pos, max_len)
            self.ropes[kind, hd] = (cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))

    @classmethod
    def load(cls, model_dir: str | Path, target_cfg: ModelConfig, target: Any, dtype: torch.dtype, max_len: int,
             device: torch.device) -> "Gemma4AssistantHead":
        """The assistant of ``model_dir`` (its config.json and safetensors)."""
        from ferry.model.loader import load_safetensors

        d = assistant_config(model_dir)
        if d is None:
            raise ValueError(f"speculative_config.model {str(model_dir)!r} is no Gemma 4 assistant")
        return cls(d, load_safetensors(Path(model_dir).expanduser()), target_cfg, target, dtype, max_len, device)

    def context(self, kv_caches: list[Any], block_ids: list[int], block_size: int, q: int
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The target's K/V rows [heads, rows, head size] that position ``q`` reads, by layer kind."""
        out = {}
        for kind, layer in self.sources.items():
            lo = 0 if kind == FULL or self.window is None else max(0, q - self.window - 1)
            pos = np.arange(lo, q)
            table = np.asarray(block_ids, dtype=np.int64)
            slots = torch.from_numpy(table[pos // block_size] * block_size + pos % block_size).to(self.device)
            k, v = (c.index_select(0, slots) for c in kv_caches[layer])
            hd = self.target_cfg.kv_heads(layer)[1]
            if k.dtype == torch.uint8:  # q8_0 rows
                k, v = dequantize_q8_0(k, self.dtype)[..., :hd], dequantize_q8_0(v, self.dtype)[..., :hd]
            out[kind] = (k.to(self.dtype).transpose(0, 1), v.to(self.dtype).transpose(0, 1))
        return out

    def step(self, token: int, hidden: torch.Tensor, q: int, ctx: dict[str, tuple[torch.Tensor, torch.Tensor]]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step at position ``q``: (logits [vocab], projected state [backbone])."""
        e = self.target._embed(torch.tensor([token], device=self.device))[0]
        x = torch.cat([e.to(self.dtype), hidden.to(self.dtype)]) @ self.pre.T
        for ly in self.layers:
            k, v = ctx[ly.kind]
            hd = ly.head_dim
            h = rms_norm(x, ly.norms[0], self.eps)
            qv = rms_norm((h @ ly.q.T).view(self.heads, hd), ly.q_norm, self.eps)
            cos, sin = (tbl[q] for tbl in self.ropes[ly.kind, hd])
            qv = apply_rope(qv, cos, sin)
            rep = self.heads // k.shape[0]
            kk, vv = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)  # [heads, rows, hd]
            att = torch.softmax(torch.einsum("hd,hrd->hr", qv, kk).float(), -1).to(self.dtype)  # scale 1
            o = torch.einsum("hr,hrd->hd", att, vv).reshape(-1) @ ly.o.T
            x = x + rms_norm(o, ly.norms[1], self.eps)
            h = rms_norm(x, ly.norms[2], self.eps)
            m = (self.act(h @ ly.gate.T) * (h @ ly.up.T)) @ ly.down.T
            x = (x + rms_norm(m, ly.norms[3], self.eps)) * ly.scalar
        y = rms_norm(x, self.norm, self.eps)
        return self.logits(y), y @ self.post.T

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of ``y``; with ordered embeddings only the tokens of the top centroids
        get theirs, the others one below their least (transformers' masked embedder, per row)."""
        if not self.ordered:
            return y @ self.lm_head.T
        per = self.lm_head.shape[0] // self.centroids.shape[0]
        top = torch.topk(y @ self.centroids.T, self.top_k).indices
        chosen = self.ordering.view(-1, per)[top].reshape(-1)
        picked = self.lm_head[chosen] @ y
        out = torch.full((self.lm_head.shape[0],), float(picked.min()) - 1.0, dtype=y.dtype, device=y.device)
        return out.scatter_(0, chosen, picked)


class Gemma4AssistantProposer(MTPProposer):
    """The assistant as the executor's drafter: it keeps each request's target hidden states (as the
    MTP proposer does) and, for each verify chunk, drafts from the target's hidden state before its
    last known token and the target's K/V in the cache (``attach``); it needs no blocks of its own."""

    def __init__(self, head: Gemma4AssistantHead, num_speculative_tokens: int, block_size: int, seed: int = 0) -> None:
        self.head, self.k, self.block_size = head, num_speculative_tokens, block_size
        self.target_caches: list[Any] = []
        self.lens: dict[str, int] = {}
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}
        self.generator = torch.Generator(head.device).manual_seed(seed + 2)

    def bytes_per_block(self, block_size: int) -> int:
        return 0

    def allocate(self, num_blocks: int, zeros: Any) -> None:
        return None

    def attach(self, kv_caches: list[Any]) -> None:
        """The target's K/V layers, which the assistant reads."""
        self.target_caches = kv_caches

    def forget(self, out: Any) -> None:
        """Drop the step's finished and preempted requests. Once per step: ``propose`` calls it."""
        for rid in list(out.finished_req_ids) + list(out.preempted_req_ids):
            self.pending.pop(rid, None)

    def propose(self, out: Any, states: Any) -> dict[str, torch.Tensor]:
        """Write each verify chunk's drafts into ``chunk.spec_token_ids``; returns the drafts'
        distributions for requests that sample at a temperature (the verifier's ``q``)."""
        self.forget(out)
        dists: dict[str, torch.Tensor] = {}
        for c in out.chunks:
            r = states[c.request_id]
            pend = self.pending.get(c.request_id)
            if c.padding or pend is None or r.sampling_params.pooling is not None:
                continue
            p0, rows = pend
            if c.start - 1 > p0:  # rows before the chunk's start are never read again
                rows, p0 = rows[c.start - 1 - p0:], c.start - 1
                self.pending[c.request_id] = (p0, rows)
            q = c.start + c.num_tokens - len(c.spec_token_ids) - 1  # the last known token's position
            if not c.spec_token_ids or not p0 <= q - 1 < p0 + len(rows):
                continue  # nothing to draft from: any placeholders stay (the verify rejects them)
            ctx = self.head.context(self.target_caches, r.block_ids, self.block_size, q)
            token, hidden, got, probs = r.all_token_ids[q], rows[q - 1 - p0], [], []
            for _ in range(len(c.spec_token_ids)):
                logits, hidden = self.head.step(token, hidden, q, ctx)
                token = self._choose(logits, r.sampling_params, probs)
                got.append(token)
            c.spec_token_ids[:] = got
            if probs:
                dists[c.request_id] = torch.stack(probs)
        return dists
