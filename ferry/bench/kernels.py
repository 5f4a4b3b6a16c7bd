"""``ferry bench kernels``: the model's matrix products at decode-sized M, by every implementation
at hand, against the bound that applies (weight bytes at DRAM bandwidth, or FLOPs at the FMA peak).

Implementations: ferry's quantized kernel (the GGUF's own weights), ferry's float32 streaming
kernel, torch (oneDNN/MKL) and numpy (OpenBLAS) on the dequantized float32 weights. Each product
cycles through the weights of every layer, as a decode step does, so the weights come from memory,
not from a cache warmed by the previous repetition.
"""
from __future__ import annotations

import time
from statistics import median
from typing import Any, Callable

import numpy as np
import torch

from ferry.bench.bandwidth import read_bandwidth
from ferry.model.kernels import load_kernels
from ferry.model.quant import QuantWeight, RowStack, dequantize, quant_linear

# (name, weight name pattern); the layer's fused products are built as the model builds them.
SHAPES = ("qkv", "o_proj", "gate_up", "down", "lm_head")


def _weights(name: str, layers: list[Any], lm_head: Any) -> list[Any]:
    if name == "lm_head":
        return [lm_head]
    return [getattr(layer.mixer if name in ("qkv", "o_proj") else layer.mlp, name) for layer in layers]


def _time(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return median(times)


def machine_bounds(threads: int) -> dict[str, float]:
    """DRAM read bandwidth (GB/s: the decode's probe, ``ferry.bench.bandwidth``; a 1 GiB sum
    without the kernels) and the float32 FMA peak (GFLOP/s, a large product), both measured now
    with ``threads`` threads."""
    bw = read_bandwidth() / 1e9
    if not bw:
        big = torch.ones(2**28)
        bw = big.numel() * 4 / _time(lambda: big.sum(), 3) / 1e9
        del big
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    peak = 2 * 1024**3 / _time(lambda: torch.mm(a, b), 5) / 1e9
    return {"dram_gb_s": bw, "fma_gflop_s": peak, "int8_gmac_s": int8_peak(), "threads": threads}


def int8_peak() -> float:
    """The int8 multiply-add peak (GMAC/s, all threads) of the instruction the q8 products use on
    this CPU (vpdpbusd, or AVX2's vpmaddubsw), measured now; 0 without the kernels or on the
    portable variant."""
    so = load_kernels()
    if so is None:
        return 0.0
    isa = so.quant_q8_isa(-2)  # the variant in use (-2 asks without changing it)
    so.int8_peak(isa, 2_000_000)  # wakes the threads
    return max(so.int8_peak(isa, 20_000_000) for _ in range(3)) / 1e9


def _is_q8(w: Any) -> bool:
    """Whether a weight's products quantize the activations (their bound is the int8 peak)."""
    return (w.parts[0] if isinstance(w, RowStack) else w).activations == "q8"


def bench_kernels(model: Any, rows: list[int], reps: int = 5) -> dict[str, Any]:
    """Per shape and M: ms, GFLOP/s and weight GB/s of each implementation, and the bound.

    numpy's products run last, all of them: OpenBLAS's threads keep spinning for a while after
    each call, and would slow whatever runs next on the two cores."""
    from ferry.model.layers.linear import skinny_linear

    bounds = machine_bounds(torch.get_num_threads())
    results: dict[tuple[str, int], dict[str, Any]] = {}
    for numpy_pass in (False, True):
        for name in SHAPES:
            quant = _weights(name, model.layers, model.lm_head)
            if not isinstance(quant[0], (QuantWeight, RowStack)):
                raise ValueError("bench kernels needs the quantized model (quantization='gguf')")
            floats = [dequantize(w) for w in quant]
            arrays = [f.numpy() for f in floats]
            n, k = quant[0].shape
            for m in rows:
                x = torch.randn(m, k)
                xn = x.numpy()
                impls = {"numpy_openblas_f32": lambda: [w @ xn.T for w in arrays]} if numpy_pass else {
                    "ferry_quant": lambda: [quant_linear(x, w) for w in quant],
                    "ferry_f32": lambda: [skinny_linear(x, w) for w in floats],
                    "torch_f32": lambda: [torch.mm(w, x.t()) for w in floats],
                }
                flops = 2 * m * n * k
                row = results.setdefault((name, m), {"shape": name, "n": n, "k": k, "m": m,
                                                     "quant_type": quant[0].qtype})
                for impl, fn in impls.items():
                    t = _time(fn, reps) / len(quant)
                    wbytes = quant[0].nbytes if impl == "ferry_quant" else n * k * 4
                    compute = flops / (bounds["fma_gflop_s"] * 1e9)
                    if impl == "ferry_quant" and _is_q8(quant[0]) and bounds["int8_gmac_s"] > 0:
                        compute = m * n * k / (bounds["int8_gmac_s"] * 1e9)
                    bound = max(wbytes / (bounds["dram_gb_s"] * 1e9), compute)
                    row[impl] = {"ms": 1e3 * t, "gflop_s": flops / t / 1e9, "gb_s": wbytes / t / 1e9,
                                 "of_bound": bound / t}
            del floats, arrays
    return {"bounds": bounds, "rows": list(results.values())}


def format_kernels(report: dict[str, Any]) -> str:
    b = report["bounds"]
    lines = [f"bounds (measured now, {b['threads']} threads): DRAM {b['dram_gb_s']:.1f} GB/s, "
             f"float32 FMA {b['fma_gflop_s']:.0f} GFLOP/s, int8 multiply-adds {b['int8_gmac_s']:.0f} G/s "
             "(the q8 products' bound)",
             "ms per product (GFLOP/s, weight GB/s, share of the bound)"]
    impls = ("ferry_quant", "ferry_f32", "torch_f32", "numpy_openblas_f32")
    lines.append(f"{'shape':<8} {'N x K':>11} {'M':>3}  " + "  ".join(f"{i:>30}" for i in impls))
    for r in report["rows"]:
        cells = [f"{r[i]['ms']:6.3f} ({r[i]['gflop_s']:4.0f}, {r[i]['gb_s']:5.1f}, {100 * r[i]['of_bound']:3.0f}%)"
                 for i in impls]
        lines.append(f"{r['shape']:<8} {r['n']:>5}x{r['k']:<5} {r['m']:>3}  " + "  ".join(f"{c:>30}" for c in cells))
    return "\n".join(lines)
