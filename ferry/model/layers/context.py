"""What every part's torch forward reads about the step: positions, attention metadata, rope
rotations, whether the C row kernels run, and the profiler's tick."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ferry.model.attention import AttentionMetadata


@dataclass
class StepContext:
    positions: torch.Tensor
    meta: AttentionMetadata
    use_kernel: bool  # float32 on the CPU: norm, rope and the activation as C row operations
    eps: float
    tick: Callable[[str], None]  # the profiler's: told each part of the pass as it ends
    ropes: list[tuple[torch.Tensor, torch.Tensor]]  # the model's rope tables (cos, sin), by index
    rotations: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # the torch path's, at the positions
    comm: Any = None  # tensor parallelism's collectives (None: one rank)
    per_layer: torch.Tensor | None = None  # [T, layers, width]: Gemma 4's per-layer inputs
