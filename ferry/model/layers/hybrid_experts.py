"""The Mamba2 hybrids' experts. Granite 4: softmax routing over gated experts stored stacked, plus a
shared gated MLP. Nemotron-H (Nemotron 3): sigmoid scores with a correction bias and group-limited
top-k, non-gated experts (in a latent space where the model has one), plus a shared non-gated MLP.
Granite 4's block decodes in the fused C decode (the experts op with its shared MLP); Nemotron-H's
has no op there, and such models decode through torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ferry.model.arch.parts import SigmoidExpertsSpec, StackedExpertsSpec
from ferry.model.fused_decode import NotFused, Op
from ferry.model.layers.context import StepContext
from ferry.model.layers.experts import RoutedExperts, experts_op
from ferry.model.layers.linear import Weight, linear
from ferry.model.layers.mlp import PLAIN_ACTIVATIONS, GatedMLP
from ferry.model.quant import packed


@dataclass
class StackedExperts:
    """Granite 4's block: routed experts (the softmax of each token's top-k logits) plus the shared MLP."""

    experts: RoutedExperts
    shared: GatedMLP
    end = "down"

    @classmethod
    def build(cls, spec: StackedExpertsSpec, w: dict[str, Any], facts: Any) -> "StackedExperts":
        if spec.stacked:  # [E, 2I, H] (each expert's gate rows first), [E, H, I]
            gate_up, down = w["experts_gate_up"], w["experts_down"]
            gate_up, down = [gate_up[e] for e in range(spec.num_experts)], [down[e] for e in range(spec.num_experts)]
        else:
            gate_up, down = w["expert_gate_up"], w["expert_down"]
        experts = RoutedExperts(w["router"], [packed(x) for x in gate_up], [packed(x) for x in down], spec.top_k,
                                spec.renorm, spec.act)
        return cls(experts, GatedMLP(packed(w["gate_up"]), packed(w["down"]), spec.act))

    def forward(self, h: torch.Tensor, ctx: StepContext, cache: Any = None) -> torch.Tensor:
        return self.experts.forward(h, ctx) + self.shared.forward(h, ctx)

    def ops(self, ctx: StepContext, cache: Any = None) -> list[Op]:
        return [experts_op(self.experts, self.shared.gate_up, self.shared.down)]


def sigmoid_route(h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, spec: SigmoidExpertsSpec
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [T, top_k]: the top k of sigmoid(h @ router) + bias among the best
    ``topk_groups`` groups (a group scores its two best), weighted by their sigmoid scores
    (renormalised where the spec says) times its scale; float32 as transformers' router."""
    scores = torch.sigmoid(F.linear(h.float(), router.float()))
    choice = scores + bias.float()
    if spec.groups > 1:
        T, E = choice.shape
        grouped = choice.view(T, spec.groups, E // spec.groups)
        best = torch.topk(grouped.topk(2, dim=-1).values.sum(-1), spec.topk_groups, dim=-1).indices
        keep = torch.zeros(T, spec.groups, dtype=torch.bool, device=h.device).scatter_(1, best, True)
        choice = choice.masked_fill(~keep[..., None].expand_as(grouped).reshape(T, E), float("-inf"))
    chosen = torch.topk(choice, spec.top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if spec.renorm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.scale, chosen


def run_experts(h: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, num_experts: int,
                expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_k weights[t, k] * expert(chosen[t, k], h[t]) for every token t; each expert runs once over
    all its tokens."""
    top_k = chosen.shape[1]
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
    tokens = order // top_k
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # one host read per layer
    xs, ys, start = h[tokens], None, 0
    for e, n in enumerate(counts):
        if n:
            y = expert(e, xs[start:start + n])
            ys = torch.empty(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device) if ys is None else ys
            ys[start:start + n] = y
            start += n
    out = torch.zeros(h.shape[0], ys.shape[1], dtype=ys.dtype, device=h.device)
    return out.index_add_(0, tokens, ys * weights.reshape(-1)[order, None].to(ys.dtype))


@dataclass
class SigmoidExperts:
    """Nemotron-H's MoE block: routed non-gated experts plus the shared non-gated MLP."""

    router: torch.Tensor  # [experts, hidden]
    bias: torch.Tensor  # [experts]: added to the scores for the choice only
    up: Sequence[Weight]  # per expert [intermediate, latent or hidden]
    down: Sequence[Weight]  # per expert [latent or hidden, intermediate]
    shared_up: Weight
    shared_down: Weight
    spec: SigmoidExpertsSpec
    latent_in: Weight | None = None  # [latent, hidden]
    latent_out: Weight | None = None  # [hidden, latent]
    end = "down"

    @classmethod
    def build(cls, spec: SigmoidExpertsSpec, w: dict[str, Any], facts: Any) -> "SigmoidExperts":
        latent = [packed(w["latent_in"]), packed(w["latent_out"])] if spec.latent else [None, None]
        return cls(w["router"], w["router_bias"], [packed(x) for x in w["expert_up"]],
                   [packed(x) for x in w["expert_down"]], packed(w["shared_up"]), packed(w["shared_down"]), spec,
                   *latent)

    def forward(self, h: torch.Tensor, ctx: StepContext, cache: Any = None) -> torch.Tensor:
        kern, act = ctx.use_kernel, PLAIN_ACTIVATIONS[self.spec.act]
        weights, chosen = sigmoid_route(h, self.router, self.bias, self.spec)
        x = h if self.latent_in is None else linear(h, self.latent_in, use_kernel=kern)

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            return linear(act(linear(rows, self.up[e], use_kernel=kern)), self.down[e], use_kernel=kern)

        routed = run_experts(x, weights, chosen, self.router.shape[0], expert)
        routed = routed if self.latent_out is None else linear(routed, self.latent_out, use_kernel=kern)
        shared = linear(act(linear(h, self.shared_up, use_kernel=kern)), self.shared_down, use_kernel=kern)
        ctx.tick("experts")
        return routed + shared

    def ops(self, ctx: StepContext, cache: Any = None) -> list[Op]:
        raise NotFused("routed experts")
