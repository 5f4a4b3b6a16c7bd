"""RMS norm, as Hugging Face's LlamaRMSNorm computes it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ferry.model.row_ops import rms_norm_rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, use_kernel: bool = False) -> torch.Tensor:
    """x normalised in float32, cast back, then scaled by ``weight``."""
    if use_kernel and x.dim() == 2 and x.dtype == torch.float32:
        return rms_norm_rows(x, weight, eps)  # the C rows, one pass each
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
