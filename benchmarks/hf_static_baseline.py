"""Baseline for the performance figures (docs/performance.md): transformers' own static `generate` on a workload.

Left-padded batches of B requests; each batch generates until its longest request
is done (ignore_eos), which is how padded static batching spends its compute.
Same dequantized fp32 weights as ferry (the cached Hugging Face directory).

    .venv/bin/python benchmarks/hf_static_baseline.py --workload benchmarks/workloads/mixed-64.json
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    from transformers import LlamaForCausalLM

    from ferry.bench.workload import load_workload
    from ferry.model.loader import resolve_model_dir

    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    reqs = load_workload(args.workload)
    model = LlamaForCausalLM.from_pretrained(str(resolve_model_dir(None)), dtype=torch.float32).eval()
    pad = 0
    t0 = time.perf_counter()
    useful = 0
    with torch.inference_mode():
        for i in range(0, len(reqs), args.batch_size):
            batch = reqs[i:i + args.batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, r in enumerate(batch):
                n = len(r.prompt_token_ids)
                ids[row, width - n:] = torch.tensor(r.prompt_token_ids)
                mask[row, width - n:] = 1
            new = max(r.max_tokens for r in batch)
            tb = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
            useful += sum(r.max_tokens for r in batch)
            print(f"batch {i // args.batch_size + 1}: {new} steps, {time.perf_counter() - tb:.1f} s", flush=True)
    dt = time.perf_counter() - t0
    print(f"transformers static generate, B={args.batch_size}: {dt:.1f} s, {useful / dt:.1f} output tok/s")


if __name__ == "__main__":
    main()
