"""Rotary position embeddings: one table of scalings (Hugging Face's ``rope_type`` names) and the rotation.

Every scaling is a change of the inverse frequencies (and, for yarn and longrope, a factor on cos
and sin); the tables are made once for the served length, so a step only indexes them.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

InvFreq = Callable[[torch.Tensor, dict[str, Any], int, int, int], tuple[torch.Tensor, float]]


def _default(inv: torch.Tensor, sc: dict[str, Any], dim: int, max_pos: int, max_len: int) -> tuple[torch.Tensor, float]:
    return inv, 1.0


def _linear(inv: torch.Tensor, sc: dict[str, Any], dim: int, max_pos: int, max_len: int) -> tuple[torch.Tensor, float]:
    return inv / sc["factor"], 1.0


def _dynamic(inv: torch.Tensor, sc: dict[str, Any], dim: int, max_pos: int, max_len: int) -> tuple[torch.Tensor, float]:
    # Hugging Face grows the base with the sequence seen so far; one table for the whole served length
    # keeps a token's rotation independent of its batch. Within max_position_embeddings both are the default.
    if max_len <= max_pos:
        return inv, 1.0
    factor, base = sc["factor"], sc["rope_theta"]
    base = base * (factor * max_len / max_pos - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0


def _llama3(inv: torch.Tensor, sc: dict[str, Any], dim: int, max_pos: int, max_len: int) -> tuple[torch.Tensor, float]:
    factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old_len = sc.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - lo) / (hi - lo)
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(is_mid, mid, scaled), 1.0


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(inv: torch.Tensor, sc: dict[str, Any], dim: int, max_pos: int, max_len: int) -> tuple[torch.Tensor, float]:
    base = sc["rope_theta"]
    old_len = sc.get("original_max_position_embeddings") or max_pos
    factor = sc.get("factor") or max_pos / old_len
    att = sc.get("attention_factor")
    if att is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        att = _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)

    def corr_dim(rot: float) -> float:
        return dim * math.log(old_len / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(sc.get("beta_fast") or 32), corr_dim(sc.get("beta_slow") or 1)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra = 1 - ramp  # 1: keep the frequency (fast dimensions), 0: interpolate it
    return inv / factor * (1 - extra) + inv * extra, float(att)


def _longrope(inv: torch.Tensor, sc: dict[str, Any], dim: int, max_pos: int, max_len: int) -> tuple[torch.Tensor, float]:
    # Phi-3: per-dimension divisors, the short ones here (``rope_tables`` takes the long ones past
    # the original length, position by position, as a KV cache needs).
    old_len = sc.get("original_max_position_embeddings") or max_pos
    factor = sc.get("factor") or max_pos / old_len
    att = sc.get("attention_factor")
    if att is None:
        att = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return inv / torch.tensor(sc["short_factor"], dtype=torch.float32), float(att)


def _freq_factors(inv: torch.Tensor, sc: dict[str, Any], dim: int, max_pos: int, max_len: int) -> tuple[torch.Tensor, float]:
    # A GGUF's rope_freqs tensor (llama.cpp's form of llama3 scaling): frequencies divided by these.
    return inv / torch.tensor(sc["factors"], dtype=torch.float32), 1.0


def _proportional(inv: torch.Tensor, sc: dict[str, Any], dim: int, max_pos: int, max_len: int
                  ) -> tuple[torch.Tensor, float]:
    # Gemma 4's global layers: the first partial_rotary_factor of the frequencies turn (the exponents
    # over the whole head), the rest are 0 (cos 1, sin 0), over a table as wide as the head.
    turned = int(sc.get("partial_rotary_factor", 1.0) * dim // 2)
    return torch.cat([inv[:turned], torch.zeros_like(inv[turned:])]) / sc.get("factor", 1.0), 1.0


def _none(inv: torch.Tensor, sc: dict[str, Any], dim: int, max_pos: int, max_len: int) -> tuple[torch.Tensor, float]:
    return torch.zeros_like(inv), 1.0  # cos 1, sin 0: layers without rope (SmolLM3's every fourth)


SCALINGS: dict[str, InvFreq] = {
    "none": _none,
    "default": _default, "linear": _linear, "dynamic": _dynamic, "llama3": _llama3, "yarn": _yarn,
    "longrope": _longrope, "freq_factors": _freq_factors, "proportional": _proportional,
}


def rope_tables(head_dim: int, theta: float, scaling: dict[str, Any] | None, max_pos: int,
                max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, [max_len, head_dim], in Hugging Face's half-split layout."""
    inv = 1.0 / (max(theta, 1.0) ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    sc = dict(scaling or {}, rope_theta=theta)
    inv, att = SCALINGS[sc.get("rope_type", "default")](inv, sc, head_dim, max_pos, max_len)
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = pos[:, None] * inv[None, :]
    if sc.get("rope_type") == "longrope":
        old_len = sc.get("original_max_position_embeddings") or max_pos
        base = inv * torch.tensor(sc["short_factor"], dtype=torch.float32)
        long = pos[:, None] * (base / torch.tensor(sc["long_factor"], dtype=torch.float32))[None, :]
        freqs = torch.where(pos[:, None] < old_len, freqs, long)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * att, emb.sin() * att


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
