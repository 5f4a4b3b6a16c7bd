"""Accelerator profiles for the cost model: presets from public datasheets, or a calibrated JSON file."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Hardware:
    """One device. Rates are peaks; the ``*_efficiency`` fields are the achievable fractions.

    A calibrated profile stores measured effective rates with efficiencies of 1.
    """

    name: str
    peak_tflops: float  # dense matrix-product peak for the dtype (no sparsity)
    mem_bandwidth_gbs: float  # GB/s
    memory_gb: float
    dtype_bytes: int = 2
    flops_efficiency: float = 0.6  # linear layers
    attn_flops_efficiency: float = 0.4  # attention: shorter, less regular products
    bw_efficiency: float = 0.8
    step_overhead_ms: float = 2.0  # scheduling, launch, sampling: paid once per step
    per_request_overhead_ms: float = 0.01  # per request in the step (metadata, sampling)
    per_prefill_chunk_ms: float = 0.0  # per chunk of more than one token (a separate prefill path)
    interconnect_gbs: float = 0.0  # per-device link bandwidth for tensor-parallel all-reduce
    # Fixed cost of one all-reduce. 25 us, not NCCL's ~10 us ring latency: vLLM's published 70B TP-4
    # decode latencies on H100 and H200 (docs/scheduling.md) sit 2.3-3.3 ms a step above the model
    # with 10 us, which is 15-20 us more for each of the step's 160 all-reduces.
    allreduce_latency_us: float = 25.0
    kv_cache_memory_gb: float | None = None  # fixed KV size (as a CPU engine is told) instead of memory - weights
    # How far compute and memory traffic hide each other: 1 is the pure roofline max(c, m) (a GPU
    # streaming weights while its tensor cores work); 0 means they add up (c + m).
    overlap: float = 1.0
    # GB/s at which a prefill chunk's cached context is copied before attention (an engine that
    # gathers it, as ferry's CPU path does); 0: no copy (GPU kernels read the paged cache in place).
    context_gather_gbs: float = 0.0

    @property
    def flops(self) -> float:
        """Achievable FLOP/s for linear layers."""
        return self.peak_tflops * 1e12 * self.flops_efficiency

    @property
    def attn_flops(self) -> float:
        return self.peak_tflops * 1e12 * self.attn_flops_efficiency

    @property
    def bandwidth(self) -> float:
        """Achievable bytes/s from device memory."""
        return self.mem_bandwidth_gbs * 1e9 * self.bw_efficiency

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")


# bf16 dense peaks and HBM bandwidths from the vendors' datasheets; NVLink per-GPU bandwidth one way.
PRESETS: dict[str, Hardware] = {
    "a100-40gb": Hardware("a100-40gb", peak_tflops=312, mem_bandwidth_gbs=1555, memory_gb=40,
                          interconnect_gbs=300),
    "a100-80gb": Hardware("a100-80gb", peak_tflops=312, mem_bandwidth_gbs=2039, memory_gb=80,
                          interconnect_gbs=300),
    "h100-sxm": Hardware("h100-sxm", peak_tflops=989, mem_bandwidth_gbs=3350, memory_gb=80,
                         interconnect_gbs=450),
    "h200": Hardware("h200", peak_tflops=989, mem_bandwidth_gbs=4800, memory_gb=141, interconnect_gbs=450),
    "l4": Hardware("l4", peak_tflops=121, mem_bandwidth_gbs=300, memory_gb=24, interconnect_gbs=32,
                   flops_efficiency=0.5),
}


def load_hardware(name_or_path: str) -> Hardware:
    """A preset name or the path of a profile JSON (as written by ``ferry simulate calibrate``)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown hardware {name_or_path!r}: give a preset ({', '.join(PRESETS)}) "
                         f"or a profile JSON file")
    data = json.loads(path.read_text())
    known = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown hardware field(s) {', '.join(unknown)}")
    try:
        return Hardware(**data)
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None
