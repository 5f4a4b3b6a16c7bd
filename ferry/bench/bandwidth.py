"""The memory floor of a decode step: how fast the engine's thread team can read memory (a probe,
kernels/int8_peak.c's read_bandwidth), how many bytes of weights one decoded token reads, and the
bandwidth a run's decode achieved against the probe's figure. A one-request decode is bound by
streaming every weight once per token, so bytes per token / time per token is its figure of merit.
"""
from __future__ import annotations

from typing import Any

import torch

from ferry.model.kernels import load_kernels
from ferry.model.quant import QuantWeight, RowStack

# The probe's buffer: far larger than any L3 (so it measures memory), small enough to allocate anywhere.
PROBE_BYTES = 512 * 2**20
PROBE_REPS = 5


def read_bandwidth(nbytes: int = PROBE_BYTES, reps: int = PROBE_REPS) -> float:
    """Bytes per second the kernels' thread team (the engine's thread count) reads from memory,
    measured now, best of ``reps``; 0.0 without the kernels."""
    so = load_kernels()
    return 0.0 if so is None else float(so.read_bandwidth(nbytes, reps))


def weight_bytes(w: Any) -> int:
    """Resident bytes of a product's weight (a float tensor, a QuantWeight or a RowStack)."""
    if isinstance(w, (QuantWeight, RowStack)):
        return int(w.nbytes)
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return 0


def decode_bytes_by_part(model: Any) -> dict[str, int] | None:
    """Bytes of weights each profiler part's products read per decoded token (the fused decode's
    product ops, plus the LM head as 'lm_head'); None where the model has no fused C decode."""
    if getattr(model, "fused", None) is None:
        return None
    parts: dict[str, int] = {}
    for seg in model._compile_ops(None) or []:
        for op in seg.ops:
            if op.code == "matmul":
                parts[op.part] = parts.get(op.part, 0) + weight_bytes(op.w)
    parts["lm_head"] = weight_bytes(model.lm_head)
    return parts


def decode_report(model: Any, time_per_token: float | None, profile: dict[str, Any] | None = None,
                  probe: float | None = None) -> tuple[list[str], dict[str, Any]]:
    """Lines for the bench's output and their JSON: the probe, the bytes a token reads, the
    bandwidth achieved at ``time_per_token`` seconds (a one-request run's median TPOT) and its
    fraction of the probe; with a step ``profile`` (StepProfiler.to_dict()), each part's ms, bytes
    and GB/s in its one-row decode steps."""
    by_part = decode_bytes_by_part(model)
    if by_part is None:
        return [], {}
    bw = read_bandwidth() if probe is None else probe
    total = sum(by_part.values())
    out: dict[str, Any] = {"probe_gb_s": bw / 1e9, "threads": torch.get_num_threads(),
                           "weight_bytes_per_token": total}
    lines = [f"{'read bandwidth (probe)':<28}{bw / 1e9:.2f} GB/s ({out['threads']} threads)",
             f"{'weights read per token':<28}{total / 2**20:.1f} MiB"]
    if time_per_token:
        got = total / time_per_token
        out.update(decode_gb_s=got / 1e9, fraction_of_probe=got / bw if bw else None)
        lines.append(f"{'decode bandwidth':<28}{got / 1e9:.2f} GB/s"
                     + (f" ({100 * got / bw:.0f}% of the probe)" if bw else ""))
    shape = (profile or {}).get("decode B=1")
    if shape:
        lines.append("one-row decode steps by part (weights / time):")
        for part, v in shape["parts"].items():
            b = by_part.get(part, 0)
            rate = f"{b / (v['ms'] / 1e3) / 1e9:7.2f} GB/s" if b and v["ms"] else ""
            lines.append(f"  {part:<10} {v['ms']:8.3f} ms {b / 2**20:9.1f} MiB {rate}")
        out["parts"] = {p: {"ms": v["ms"], "bytes": by_part.get(p, 0)} for p, v in shape["parts"].items()}
    return lines, out
