"""The GPU check: parity with transformers, batching invariance, and throughput, on CUDA.

    scripts/gpu_check.sh            (on a machine with a CUDA GPU and PyTorch; see its header)

Weights: the embedded model cannot travel to a machine without network access in one piece
(92 MB of GGUF), so the check builds a Llama with SmolLM2-135M's exact shapes and random weights
with transformers, saves it as safetensors, and runs both engines on it. The embedding (tied LM
head) is scaled up so every greedy choice has a clear margin: random weights with the usual
0.02 init give near-uniform logits, where any two correct implementations tie-break differently.
Speed does not depend on the weights' values (benchmarks use ignore_eos).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def build_model(config_dir: Path, out: Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig.from_pretrained(str(config_dir))
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(25.0)  # peaked logits: no near-ties in greedy choices
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))  # safetensors
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (config_dir / name).is_file():
            (out / name).write_bytes((config_dir / name).read_bytes())
    return out


def parity_prompts(model_dir: Path) -> list[list[int]]:
    """The test suite's parity prompts: 8 cuts of one text, 5 to 400 tokens."""
    from ferry.model.tokenizer import load_tokenizer
    from tests.conftest import LONG_TEXT

    ids = load_tokenizer(model_dir).encode(LONG_TEXT * 2, add_special_tokens=False)
    lengths, offsets = [5, 17, 42, 90, 150, 230, 310, 400], [0, 11, 40, 7, 63, 120, 25, 3]
    return [ids[o:o + n] for o, n in zip(offsets, lengths)]


def hf_greedy(model_dir: Path, prompts: list[list[int]], n: int, device: str) -> list[list[int]]:
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    del m
    if device == "cuda":
        torch.cuda.empty_cache()
    return outs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config-dir", type=Path, required=True, help="config.json (+ tokenizer) of the model shape")
    ap.add_argument("--workload", type=Path, required=True, help="mixed-64.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ferry-gpu"))
    ap.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself (with --quick)")
    ap.add_argument("--quick", action="store_true", help="8 requests of the workload, 128-token single request")
    args = ap.parse_args()
    dev = args.device

    from ferry import LLM, SamplingParams
    from ferry.bench.runner import run_workload
    from ferry.bench.workload import load_workload, synthetic_workload

    summary: dict = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else dev, "torch": torch.__version__}
    t0 = time.perf_counter()
    model_dir = build_model(args.config_dir, args.work / "model")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = parity_prompts(model_dir)
    n_new = 32

    # 1. Greedy parity against transformers, float32 on CUDA.
    ref = hf_greedy(model_dir, prompts, n_new, dev)
    # A fixed cache for the float32 engines: each would otherwise take 90% of the GPU.
    llm = LLM(model=str(model_dir), device=dev, dtype="float32", num_kv_blocks=4096)
    sp = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    summary["parity_float32"] = [a == b for a, b in zip(outs, ref)]

    # 2. Batching invariance on CUDA: alone, together, tiny chunks, preemption.
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    small = LLM(model=str(model_dir), device=dev, dtype="float32", max_num_batched_tokens=16, num_kv_blocks=4096)
    tight = LLM(model=str(model_dir), device=dev, dtype="float32", num_kv_blocks=80, max_num_batched_tokens=256)
    chunked = [o.outputs[0].token_ids for o in small.generate(prompts, sp, use_tqdm=False)]
    preempted = [o.outputs[0].token_ids for o in tight.generate(prompts, sp, use_tqdm=False)]
    summary["invariance"] = {"together_equals_alone": outs == alone, "chunked_equals_alone": chunked == alone,
                             "preempted_equals_alone": preempted == alone,
                             "preemptions": tight.engine.num_preemptions}
    del llm, small, tight
    import gc

    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()

    # 3. Throughput in bfloat16 (the CUDA default): mixed-64 offline, and one 1024/128 request.
    bf = LLM(model=str(model_dir), device=dev)
    summary["bf16_kv_blocks"] = bf.engine.num_kv_blocks
    mixed = load_workload(args.workload)[:8 if args.quick else None]
    run_workload(bf.engine, mixed[:8], progress=False)  # warm-up
    m = run_workload(bf.engine, mixed, progress=False).metrics
    summary["mixed64"] = {k: m.to_dict()[k] for k in ("duration", "output_throughput", "total_token_throughput",
                                                      "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms")}
    single = synthetic_workload(1, 128 if args.quick else 1024, 128, seed=0, vocab_size=vocab)
    run_workload(bf.engine, single, progress=False)  # warm-up
    runs = [run_workload(bf.engine, single, progress=False).metrics for _ in range(3)]
    mid = sorted(runs, key=lambda r: r.duration)[1].to_dict()
    summary["single_1024_128"] = {k: mid[k] for k in ("duration", "median_ttft_ms", "median_tpot_ms")}

    # 4. The simulator's H200 preset on the same two workloads.
    from ferry.config import EngineConfig
    from ferry.model.config import ModelConfig
    from ferry.sim.engine import SimEngineFactory
    from ferry.sim.hardware import load_hardware

    f = SimEngineFactory(ModelConfig.from_dir(model_dir), load_hardware("h200"))
    sm = run_workload(f.engine(EngineConfig(model=str(model_dir))), mixed, progress=False).metrics.to_dict()
    ss = run_workload(f.engine(EngineConfig(model=str(model_dir))), single, progress=False).metrics.to_dict()
    summary["sim_h200"] = {"mixed64_duration": sm["duration"], "mixed64_median_tpot_ms": sm["median_tpot_ms"],
                           "single_median_ttft_ms": ss["median_ttft_ms"], "single_median_tpot_ms": ss["median_tpot_ms"]}

    def err(sim: float, real: float) -> str:
        return f"{(sim - real) / real:+.0%}"

    summary["sim_error"] = {
        "mixed64_duration": err(sm["duration"], summary["mixed64"]["duration"]),
        "mixed64_median_tpot": err(sm["median_tpot_ms"], summary["mixed64"]["median_tpot_ms"]),
        "single_ttft": err(ss["median_ttft_ms"], summary["single_1024_128"]["median_ttft_ms"]),
        "single_tpot": err(ss["median_tpot_ms"], summary["single_1024_128"]["median_tpot_ms"])}
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    ok = all(summary["parity_float32"]) and all(v for k, v in summary["invariance"].items() if k != "preemptions")
    print("GPU CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
