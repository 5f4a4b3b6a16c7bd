"""The gated MLP: act(gate) * up, then down, with gate and up as one product; and the plain one,
act(up), then down (Nemotron-H's relu^2)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ferry.model.arch.parts import MLPSpec, PlainMLPSpec
from ferry.model.fused_decode import NotFused, Op
from ferry.model.layers.context import StepContext
from ferry.model.layers.linear import Weight, linear
from ferry.model.quant import packed
from ferry.model.row_ops import gated_act_rows


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu_tanh": _gelu_tanh}


@dataclass
class GatedMLP:
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight
    act: str = "silu"
    # Its fused-decode rows packed (gated_act_n): layers of their own widths (Gemma 4's double-wide MLPs).
    packed_rows: bool = False
    end = "down"  # the profiler's name for the residual add after it

    @classmethod
    def build(cls, spec: MLPSpec, w: dict[str, Any], facts: Any) -> "GatedMLP":
        return cls(packed(w["gate_up"]), packed(w["down"]), spec.act, spec.intermediate is not None)

    def forward(self, h: torch.Tensor, ctx: StepContext, cache: Any = None) -> torch.Tensor:
        gate_up = linear(h, self.gate_up, use_kernel=ctx.use_kernel)
        ctx.tick("gate_up")
        if ctx.use_kernel:
            h = gated_act_rows(gate_up, self.act == "gelu_tanh")
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = ACTIVATIONS[self.act](gate) * up
        ctx.tick("act")
        return linear(h, self.down, use_kernel=ctx.use_kernel)

    def ops(self, ctx: StepContext, cache: Any = None) -> list[Op]:
        inter, hidden = self.gate_up.shape[0] // 2, self.gate_up.shape[1]
        if self.packed_rows:
            gelu = int(self.act == "gelu_tanh")
            return [Op("matmul", "h", "gu", "gate_up", w=self.gate_up, n=2 * inter, k=hidden, width=2 * inter, packed=True),
                    Op("gated_act_n", "gu", "act", "act", n=inter, k=gelu, width=inter, packed=True),
                    Op("matmul", "act", "out", "down", w=self.down, n=hidden, k=inter, width=hidden, packed=True)]
        return [Op("matmul", "h", "gu", "gate_up", w=self.gate_up, n=2 * inter, k=hidden, width=2 * inter),
                Op("gated_act", "gu", "act", "act", n=int(self.act == "gelu_tanh"), width=inter),
                Op("matmul", "act", "out", "down", w=self.down, n=hidden, k=inter, width=hidden)]


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


# The plain MLP's activations: the gated ones', and squared ReLU.
PLAIN_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {**ACTIVATIONS, "relu2": _relu2}


@dataclass
class PlainMLP:
    up: Weight  # [intermediate, hidden]
    down: Weight  # [hidden, intermediate]
    act: str = "relu2"
    end = "down"  # the profiler's name for the residual add after it

    @classmethod
    def build(cls, spec: PlainMLPSpec, w: dict[str, Any], facts: Any) -> "PlainMLP":
        return cls(packed(w["up"]), packed(w["down"]), spec.act)

    def forward(self, h: torch.Tensor, ctx: StepContext, cache: Any = None) -> torch.Tensor:
        up = linear(h, self.up, use_kernel=ctx.use_kernel)
        ctx.tick("up")
        h = PLAIN_ACTIVATIONS[self.act](up)
        ctx.tick("act")
        return linear(h, self.down, use_kernel=ctx.use_kernel)

    def ops(self, ctx: StepContext, cache: Any = None) -> list[Op]:
        if self.act != "relu2":
            raise NotFused(f"the fused C decode has no {self.act} op")
        inter, hidden = self.up.shape[0], self.up.shape[1]
        return [Op("matmul", "h", "gu", "gate_up", w=self.up, n=inter, k=hidden, width=inter),
                Op("relu2", "gu", "act", "act", width=inter),
                Op("matmul", "act", "out", "down", w=self.down, n=hidden, k=inter, width=hidden)]
