"""Routed experts: a router picks each token's top k experts, each a gated MLP; the outputs are
summed by the router's weights, plus a shared expert's output scaled by sigmoid of its one-row gate
where the model has one. gpt-oss adds biases (router, gate/up, down) and its clamped SwiGLU. The
fused C decode's op (decode_layers.c's routed_experts) does the same, the shared expert included."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ferry.model.arch.parts import ExpertsSpec
from ferry.model.fused_decode import NotFused, Op
from ferry.model.layers.context import StepContext
from ferry.model.layers.linear import Weight, linear
from ferry.model.layers.mlp import ACTIVATIONS
from ferry.model.quant import RowStack, packed


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, renorm: bool,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [T, top_k] of each token: the softmax's top k, renormalised if ``renorm``
    (which is the softmax of the top k logits, gpt-oss's routing)."""
    probs = torch.softmax(F.linear(h, router, bias).float(), dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


@dataclass
class RoutedExperts:
    router: torch.Tensor  # [experts, hidden]
    gate_up: Sequence[Weight]  # per expert [2 * intermediate, hidden] (kept quantized where the file is)
    down: Sequence[Weight]  # per expert [hidden, intermediate]
    top_k: int
    renorm: bool = False
    act: str = "silu"
    shared_gate_up: Weight | None = None  # [2 * shared intermediate, hidden]: the shared expert every token runs
    shared_down: Weight | None = None
    shared_router: torch.Tensor | None = None  # [1, hidden]: its output times sigmoid(h @ this)
    router_bias: torch.Tensor | None = None  # [experts]
    gate_up_bias: Sequence[torch.Tensor] | None = None  # per expert [2 * intermediate]
    down_bias: Sequence[torch.Tensor] | None = None  # per expert [hidden]
    swiglu: tuple[float, float] = (1.702, 7.0)  # act "swiglu_clamp"'s (alpha, limit)
    end = "down"

    @classmethod
    def build(cls, spec: ExpertsSpec, w: dict[str, Any], facts: Any) -> "RoutedExperts":
        shared = [packed(w["shared_gate_up"]), packed(w["shared_down"]), w["shared_router"]] \
            if spec.shared_intermediate else [None, None, None]
        return cls(w["router"], [packed(x) for x in w["expert_gate_up"]], [packed(x) for x in w["expert_down"]],
                   spec.top_k, spec.renorm, spec.act, *shared, w.get("router_bias"), w.get("expert_gate_up_bias"),
                   w.get("expert_down_bias"), spec.swiglu)

    def _glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of an expert's gate and up columns (gpt-oss's clamped form for "swiglu_clamp")."""
        gate, up = gate_up.chunk(2, dim=-1)
        if self.act != "swiglu_clamp":
            return ACTIVATIONS[self.act](gate) * up
        alpha, limit = self.swiglu
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def forward(self, h: torch.Tensor, ctx: StepContext | None = None, cache: Any = None) -> torch.Tensor:
        """Each token's top-k experts, weighted; each expert runs once over all its tokens."""
        weights, chosen = route(h, self.router, self.top_k, self.renorm, self.router_bias)
        return self.mix(h, weights, chosen, ctx)

    def mix(self, h: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
            ctx: StepContext | None = None) -> torch.Tensor:
        """The experts ``chosen`` [T, top_k] of each token of ``h``, summed by ``weights`` (routed by
        the caller: Gemma 4 routes on another norm of the block's input than its experts read)."""
        use_kernel = ctx is not None and ctx.use_kernel
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.router.shape[0]).tolist()  # one host read per layer
        xs, ys, start = h[tokens], torch.empty_like(h[tokens]), 0
        for e, n in enumerate(counts):
            if n:
                gu_bias, down_bias = ((None, None) if self.gate_up_bias is None
                                      else (self.gate_up_bias[e], self.down_bias[e]))
                gate_up = linear(xs[start:start + n], self.gate_up[e], gu_bias, use_kernel=use_kernel)
                ys[start:start + n] = linear(self._glu(gate_up), self.down[e], down_bias, use_kernel=use_kernel)
                start += n
        out = torch.zeros_like(h)
        out = out.index_add_(0, tokens, ys * weights.reshape(-1)[order, None].to(h.dtype))
        if self.shared_gate_up is not None:
            shared = linear(self._glu(linear(h, self.shared_gate_up, use_kernel=use_kernel)), self.shared_down,
                            use_kernel=use_kernel)
            out = out + torch.sigmoid(F.linear(h, self.shared_router)) * shared
        if ctx is not None:
            ctx.tick("experts")
        return out

    def ops(self, ctx: StepContext, cache: Any = None) -> list[Op]:
        return [experts_op(self, self.shared_gate_up, self.shared_down, self.shared_router)]


def experts_op(experts: RoutedExperts, shared_gate_up: Weight | None = None, shared_down: Weight | None = None,
               shared_router: torch.Tensor | None = None) -> Op:
    """The fused C decode's op for ``experts``, plus a shared gated MLP on every row where given
    (its output times sigmoid(h @ ``shared_router``) where that is given): decode_layers.c's
    routed_experts."""
    e = experts
    shared = [] if shared_gate_up is None else [shared_gate_up, shared_down]
    if any(isinstance(w, RowStack) for w in [*e.gate_up, *e.down, *shared]):
        raise NotFused("experts whose products stack several quantized types")
    act = {"silu": 0, "gelu_tanh": 1, "swiglu_clamp": 2}.get(e.act)
    if act is None or (shared and act == 2):
        raise NotFused(f"the fused C decode has no {e.act} experts{' with a shared one' if shared else ''}")
    n_experts, hidden = e.router.shape
    inter = e.gate_up[0].shape[0] // 2
    # The router's bias, the clamped SwiGLU's alpha and limit, then the shared expert's gate row.
    params = torch.cat([torch.zeros(n_experts) if e.router_bias is None else e.router_bias.float(),
                        torch.tensor(e.swiglu, dtype=torch.float32),
                        torch.zeros(0) if shared_router is None else shared_router.float().reshape(-1)])
    stacked = [None if b is None else torch.stack(list(b)).float().contiguous()
               for b in (e.gate_up_bias, e.down_bias)]
    shared_inter = shared_gate_up.shape[0] // 2 if shared else 0
    return Op("experts", "h", "out", "experts", w=e.router.float().contiguous(), w2=params.contiguous(),
              w3=stacked[0], w4=stacked[1], n=hidden, k=hidden, width=hidden, experts=[*e.gate_up, *e.down, *shared],
              shape=(n_experts, e.top_k, inter, int(e.renorm), act, shared_inter, int(shared_router is not None)))
