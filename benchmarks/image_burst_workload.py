"""Workloads for decoding beside an image burst: ``--decoders`` requests decode (short prompts, long
answers) from 0 s; in the burst file ``--images`` more requests, each one image of ``--size`` and a
few text tokens (one output token: they add no inter-token samples), arrive together at ``--at`` s.
Compare the decoders' p99 inter-token latency of the two files (`ferry bench online --workload`).

    python benchmarks/image_burst_workload.py --out-dir /tmp/burst   # alone.json, burst.json
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

from ferry.bench.workload import WorkloadRequest, save_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--decode-len", type=int, default=128)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--size", default="448x448")
    p.add_argument("--at", type=float, default=1.0)
    args = p.parse_args()
    w, h = (int(v) for v in args.size.split("x"))
    rng = random.Random(0)
    decoders = [WorkloadRequest([rng.randrange(1000, 40000) for _ in range(32)], args.decode_len)
                for _ in range(args.decoders)]
    burst = [WorkloadRequest([rng.randrange(1000, 40000) for _ in range(16)], 1, arrival_time=args.at,
                             image_sizes=((w, h),)) for _ in range(args.images)]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    save_workload(decoders, args.out_dir / "alone.json")
    save_workload(decoders + burst, args.out_dir / "burst.json")


if __name__ == "__main__":
    main()
