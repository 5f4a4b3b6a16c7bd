"""The KV cache's tensors: which layers keep K/V, grouped by their cache's shape, what one block
costs, and each layer's (K, V) views. The target and a draft model size and lay out theirs alike."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ferry.model.config import ModelConfig
from ferry.model.kv_format import row_width


def kv_groups(cfg: ModelConfig) -> dict[tuple[int, int], list[int]]:
    """The attention layers that keep K/V of their own, by their cache's (KV heads, head size): one
    group but where layers differ (Gemma 4's global layers); one empty group where none keeps K/V."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i in cfg.kv_cache_layers:
        groups.setdefault(cfg.kv_heads(i), []).append(i)
    return groups or {(cfg.num_kv_heads, cfg.head_dim): []}


def block_bytes(groups: dict[tuple[int, int], list[int]], block_size: int, kv_dtype: torch.dtype,
                heads: int | None = None) -> int:
    """What one KV block costs: K and V of ``block_size`` tokens in every layer of ``groups``
    (``heads``: the KV heads a tensor-parallel rank holds, instead of each group's)."""
    elem = torch.tensor([], dtype=kv_dtype).element_size()
    return max(1, sum(2 * len(layers) * block_size * (heads or h) * row_width(hd, kv_dtype) * elem
                      for (h, hd), layers in groups.items()))


def allocate(num_layers: int, groups: dict[tuple[int, int], list[int]], slots: int, kv_dtype: torch.dtype,
             zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor], heads: int | None = None) -> list[Any]:
    """Per layer, the (K, V) tensors [slots, KV heads, row] of a layer in ``groups``, else None;
    ``zeros(shape, dtype)`` makes each group's one tensor."""
    caches: list[Any] = [None] * num_layers
    for (h, hd), layers in groups.items():
        # The last dimension holds a head's values (row_width: in the cache's format).
        cache = zeros((max(1, len(layers)), 2, slots, heads or h, row_width(hd, kv_dtype)), kv_dtype)
        for j, i in enumerate(layers):
            caches[i] = (cache[j, 0], cache[j, 1])
    return caches
