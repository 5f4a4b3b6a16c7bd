"""Megatron-style tensor parallelism for the Llama-family layers: what each rank holds, and the
collectives that join the ranks' partial results.

Per layer, with N ranks:
- qkv and gate_up are column-parallel: each rank computes its own heads and its own slice of the
  MLP's intermediate size, so attention and the activation need no communication;
- o_proj and down are row-parallel: each rank multiplies its slice of the input and the partial
  products are summed by one all-reduce each;
- the embedding and LM head are vocab-parallel: a rank holds a slice of the vocabulary's rows, an
  all-reduce joins the embedding lookups, an all-gather the logits.
Heads are split by KV group (a KV head with the query heads that read it), so a rank never needs
another rank's keys; when there are fewer KV heads than ranks each KV head is replicated on the
ranks that share its query heads. Groups need not divide evenly (SmolLM2's 3 KV heads go 2 + 1
on 2 ranks): a rank's slices are contiguous and may differ in size.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ferry.model.quant import QuantWeight, dequantize
from ferry.model.shard_plan import ShardPlan, split

Weight = torch.Tensor | QuantWeight


def _file_layout(w: Weight) -> None:
    """Cuts slice the file's blocks: a weight packed by 16 rows (quant.pack_rows16) is cut before packing."""
    if isinstance(w, QuantWeight) and w.packed:
        raise ValueError("a weight packed by 16 rows cannot be sharded: shard it before packing")


def shard_rows(w: Weight, start: int, end: int) -> Weight:
    """Output rows [start, end) of a [N, K] weight (or a bias)."""
    _file_layout(w)
    if isinstance(w, QuantWeight):
        return QuantWeight(w.data[start:end].contiguous(), w.qtype, (end - start, w.shape[1]), w.activations)
    return w[start:end].contiguous()


def shard_cols(w: Weight, start: int, end: int) -> Weight:
    """Input columns [start, end) of a [N, K] weight. A quantized weight stays quantized when the
    cut falls on its blocks (32 weights, 256 for K-quants); otherwise that shard is dequantized."""
    _file_layout(w)
    if isinstance(w, QuantWeight):
        qk, per_block = w.kind.block, w.kind.nbytes
        if start % qk == 0 and end % qk == 0:
            data = w.data[:, start // qk * per_block:end // qk * per_block].contiguous()
            return QuantWeight(data, w.qtype, (w.shape[0], end - start), w.activations)
        w = dequantize(w)
    return w[:, start:end].contiguous()


class Collectives(Protocol):
    """The two operations tensor parallelism needs between ranks."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather_vocab(self, x: torch.Tensor) -> torch.Tensor: ...

    def agree_min(self, value: int) -> int: ...


class TorchDistributed:
    """Collectives over this process's default torch.distributed group (gloo on the CPU, nccl
    on CUDA), which the worker process set up for its rank."""

    def __init__(self, plan: ShardPlan, vocab_size: int) -> None:
        self.plan = plan
        self.vocab_size = vocab_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x)
        return x

    def agree_min(self, value: int) -> int:
        """The least of every rank's ``value`` (the KV blocks all ranks can hold)."""
        import torch.distributed as dist

        # nccl reduces only CUDA tensors; gloo takes CPU ones.
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, this rank's vocab slice] -> [rows, vocab]: the shards in rank order (each
        padded to the largest, as the collective needs equal sizes, then trimmed)."""
        import torch.distributed as dist

        p = self.plan
        pad = p.max_vocab_shard - x.shape[1]
        if pad:
            x = torch.nn.functional.pad(x, (0, pad))
        parts = [torch.empty_like(x) for _ in range(p.world)]
        dist.all_gather(parts, x.contiguous())
        sizes = [split(self.vocab_size, p.world, r) for r in range(p.world)]
        return torch.cat([part[:, :e - s] for part, (s, e) in zip(parts, sizes)], dim=1)
