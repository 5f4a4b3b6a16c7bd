"""The parts a decoder layer is built from, as its architecture declares (``ferry.model.arch.parts``).

Each part holds its weights and computes two ways: ``forward`` on packed tokens with torch (and
the C row kernels where they run), and ``ops``, the same computation as the fused C decode's op
list (``ferry.model.fused_decode``), which raises NotFused where the C side has no op for it. A
new layer kind is a new part here plus one line in ``PARTS``.
"""
from __future__ import annotations

from typing import Any, Callable

from ferry.model.layers.attention import Attention
from ferry.model.layers.experts import RoutedExperts
from ferry.model.layers.gated_deltanet import GatedDeltaNet
from ferry.model.layers.mlp import GatedMLP
from ferry.model.layers.short_conv import ShortConv
from ferry.model.layers.attention_nope import NoRopeAttention
from ferry.model.layers.hybrid_experts import SigmoidExperts, StackedExperts
from ferry.model.layers.mamba2 import Mamba2
from ferry.model.layers.mlp import PlainMLP
from ferry.model.layers.gemma4 import Gemma4Attention, Gemma4MoE

# A declaration's kind -> the part that computes it: build(spec, weights by role, model facts).
PARTS: dict[str, Callable[..., Any]] = {"attention": Attention.build, "mlp": GatedMLP.build,
                                        "experts": RoutedExperts.build,
                                        "short_conv": ShortConv.build,
                                        "gated_deltanet": GatedDeltaNet.build,
                                        "mamba2": Mamba2.build, "plain_mlp": PlainMLP.build,
                                        "attention_nope": NoRopeAttention.build,
                                        "stacked_experts": StackedExperts.build, "sigmoid_experts": SigmoidExperts.build,
                                        "gemma4_attention": Gemma4Attention.build, "gemma4_moe": Gemma4MoE.build}
