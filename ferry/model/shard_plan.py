"""Which part of a Llama-family model each tensor-parallel rank holds. Pure Python (the simulator
reads it too, without torch); ``tensor_parallel.py`` explains the sharding."""
from __future__ import annotations

from dataclasses import dataclass

from ferry.model.config import ModelConfig

QK = 32  # quantized weights come in blocks of this many (ferry.model.quant): cuts fall on them
QK_K = 256  # K-quants' super-blocks (Q2_K..Q6_K, IQ4_XS): MLP cuts fall on them where the size allows


def split(n: int, parts: int, rank: int, align: int = 1) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share [start, end) of ``n`` items in ``parts`` near-equal shares,
    each boundary a multiple of ``align`` where ``n`` allows it (quantized blocks of 32)."""
    units = n // align if n % align == 0 else n
    size = align if n % align == 0 else 1
    base, extra = divmod(units, parts)
    start = rank * base + min(rank, extra)
    end = start + base + (1 if rank < extra else 0)
    return start * size, end * size


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``world`` holds: query heads, KV heads, MLP columns, vocabulary rows."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]
    vocab: tuple[int, int]
    max_vocab_shard: int  # the largest rank's vocabulary slice (the all-gather's size)
    max_kv_heads: int  # the most KV heads any rank holds (every rank sizes its cache for it)
    experts: tuple[int, int] = (0, 0)  # every expert's MLP columns this rank holds (mixtures of experts)

    @classmethod
    def make(cls, cfg: ModelConfig, rank: int, world: int) -> "ShardPlan":
        """The plan, or a ValueError naming what does not split over ``world`` ranks."""
        hq, hkv = cfg.num_heads, cfg.num_kv_heads
        if world < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
        if world > 1 and cfg.recurrent_layers:
            raise ValueError(f"tensor_parallel_size {world}: {cfg.architecture}'s recurrent layers are not split "
                             "over ranks; use tensor_parallel_size 1")
        if world > 1 and any(getattr(x.mixer, "o_bias", False) or getattr(x.mlp, "bias", False) for x in cfg.layers):
            raise ValueError(f"tensor_parallel_size {world}: {cfg.architecture}'s output and experts' biases are not "
                             "split over ranks; use tensor_parallel_size 1")
        if world > 1 and (cfg.per_layer_input or any(cfg.kv_heads(i) != (hkv, cfg.head_dim) or
                                                     cfg.layers[i].attention.kv_source is not None
                                                     for i in cfg.attention_layers)):
            raise ValueError(f"tensor_parallel_size {world}: {cfg.architecture}'s layers of their own head sizes, "
                             "shared K/V or per-layer inputs are not split over ranks; use tensor_parallel_size 1")
        group = hq // hkv
        if hkv >= world:
            kv = split(hkv, world, rank)
            q = (kv[0] * group, kv[1] * group)
            max_kv = -(-hkv // world)
        else:
            # Fewer KV heads than ranks: each is replicated on world / hkv ranks, which split its
            # query heads.
            if world % hkv or hq % world:
                raise ValueError(f"tensor_parallel_size {world} does not split this model: with fewer KV heads "
                                 f"({hkv}) than ranks, it must be a multiple of the KV heads and divide the "
                                 f"attention heads ({hq})")
            per = hq // world
            q = (rank * per, (rank + 1) * per)
            kv = (q[0] // group, q[0] // group + 1)
            max_kv = 1
        if cfg.intermediate_size < world or cfg.vocab_size < world:
            raise ValueError(f"tensor_parallel_size {world} is more than the model's intermediate size or vocabulary")
        vocab = split(cfg.vocab_size, world, 0)
        mlp_align = QK_K if cfg.intermediate_size % QK_K == 0 and cfg.intermediate_size >= QK_K * world else QK
        experts = (0, 0)
        if cfg.experts is not None:  # each rank holds a slice of every expert, as of a dense MLP
            mi = cfg.experts.intermediate
            if mi < world:
                raise ValueError(f"tensor_parallel_size {world} is more than the experts' intermediate size")
            experts = split(mi, world, rank, QK_K if mi % QK_K == 0 and mi >= QK_K * world else QK)
        return cls(rank, world, q, kv, split(cfg.intermediate_size, world, rank, mlp_align),
                   split(cfg.vocab_size, world, rank), vocab[1] - vocab[0], max_kv, experts)

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]
