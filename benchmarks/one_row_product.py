"""One activation row against a packed q8 weight: its bytes per second with the weight in cache and
streamed from memory, beside the machine's read bandwidth (the probe `ferry bench` prints).

A decode step of one request is a chain of such products; if the streamed figure is well under both
the cached one and the probe, reading and arithmetic do not overlap. The weight is random blocks of
the type (valid scales); the streamed run cycles through copies of it larger than any cache.

    python benchmarks/one_row_product.py Q4_K 8192 2048
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
import torch

from ferry.bench.bandwidth import read_bandwidth
from ferry.model.quant import QUANT_TYPES, QuantWeight, pack_rows16, quant_linear

# Where each type keeps its float16 scales in a block (so random blocks get small, finite ones).
SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q5_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2)}


def weight(qtype: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """A packed q8 weight of random blocks of ``qtype`` (scales 0.01)."""
    t = QUANT_TYPES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, size=(n, k // t.block, t.nbytes), dtype=np.uint8)
    h = np.float16(0.01).view(np.uint16)
    for p in SCALES[qtype]:
        raw[:, :, p], raw[:, :, p + 1] = h & 255, h >> 8
    return pack_rows16(QuantWeight(torch.from_numpy(raw.reshape(n, -1)), qtype, (n, k), activations="q8"))


def seconds(ws: list[QuantWeight], x: torch.Tensor, reps: int) -> float:
    """Median seconds of one pass over every weight of ``ws``."""
    for w in ws:
        quant_linear(x, w)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for w in ws:
            quant_linear(x, w)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("qtype", choices=sorted(SCALES))
    p.add_argument("n", type=int, help="output rows")
    p.add_argument("k", type=int, help="input columns")
    p.add_argument("--streamed-mib", type=int, default=640, help="bytes of copies the streamed run cycles through")
    p.add_argument("--threads", type=int, help="threads of the product and the probe (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hot = weight(args.qtype, args.n, args.k)
    x = torch.randn(1, args.k)
    cached = hot.nbytes / seconds([hot], x, 200)
    copies = [dataclasses.replace(hot, data=hot.data.clone())
              for _ in range(max(1, (args.streamed_mib << 20) // hot.nbytes))]
    streamed = sum(w.nbytes for w in copies) / seconds(copies, x, 10)
    print(f"{args.qtype} {args.n}x{args.k} ({hot.nbytes / 2**20:.2f} MiB), {torch.get_num_threads()} threads: "
          f"in cache {cached / 1e9:.1f} GB/s, streamed {streamed / 1e9:.1f} GB/s, probe {read_bandwidth() / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
