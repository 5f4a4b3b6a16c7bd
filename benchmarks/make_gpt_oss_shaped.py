"""Write a checkpoint directory of gpt-oss-20b's shapes with random weights, its experts stored as the
published checkpoint stores them (MXFP4 ``*_blocks`` and E8M0 ``*_scales``), the rest bfloat16:
the input of llama.cpp's converter, whose output llama-quantize turns into an MXFP4_MOE file.

    .venv/bin/python benchmarks/make_gpt_oss_shaped.py OUT_DIR --layers 4 --tokenizer DIR
    python $LLAMA/convert_hf_to_gguf.py OUT_DIR --outtype bf16 --outfile F.gguf
    $LLAMA/build/bin/llama-quantize F.gguf gpt-oss-20b-4l-MXFP4_MOE.gguf MXFP4_MOE

gpt-oss-20b's widths (hidden 2880, 64 query and 8 KV heads of 64, 32 experts of 2880 taking 4, a
201088-token vocabulary, windows of 128 on every other layer); fewer layers keep it in this
machine's memory. The tokenizer is any GPT-2-style one (``tokenizer.json``; the converter pads its
vocabulary to the model's): token ids past it never occur in a random benchmark's prompts.
Written one layer a shard, so at most one layer's tensors are in memory.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

# openai/gpt-oss-20b's config.json, less its layer count.
CONFIG = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
          "attention_dropout": 0.0, "eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": 4,
          "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
          "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072,
          "num_attention_heads": 64, "num_experts_per_tok": 4, "num_key_value_heads": 8, "num_local_experts": 32,
          "output_router_logits": False, "rms_norm_eps": 1e-05,
          "quantization_config": {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]},
          "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                           "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
          "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088}
# E8M0 scales of 2^-7 and 2^-8: E2M1 codes (|value| up to 6) then weigh about as a 0.02-std matrix.
SCALE_BYTES = (119, 120)


def dense(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Random bfloat16 of std 0.02, made 8192 rows at a time (the vocabulary's matrices are big)."""
    out = torch.empty(*shape, dtype=torch.bfloat16)
    for r in range(0, shape[0], 8192):
        part = out[r:r + 8192]
        part.copy_(torch.randn(part.shape, generator=g) * 0.02)
    return out


def mxfp4(g: torch.Generator, experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks [E, rows, cols / 32, 16] (two E2M1 codes a byte) and scales [E, rows, cols / 32]."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    pick = torch.randint(0, len(SCALE_BYTES), (experts, rows, cols // 32), generator=g)
    return blocks, torch.tensor(SCALE_BYTES, dtype=torch.uint8)[pick]


def layer_tensors(g: torch.Generator, i: int, c: dict) -> dict[str, torch.Tensor]:
    h, e, inter, hd = c["hidden_size"], c["num_local_experts"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    p = f"model.layers.{i}."
    out = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
           p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
           p + "self_attn.sinks": dense(g, c["num_attention_heads"]),
           p + "mlp.router.weight": dense(g, e, h), p + "mlp.router.bias": dense(g, e),
           p + "mlp.experts.gate_up_proj_bias": dense(g, e, 2 * inter),
           p + "mlp.experts.down_proj_bias": dense(g, e, h)}
    for name, (n, k) in {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}.items():
        out[p + f"self_attn.{name}.weight"], out[p + f"self_attn.{name}.bias"] = dense(g, n, k), dense(g, n)
    for name, (n, k) in {"gate_up_proj": (2 * inter, h), "down_proj": (h, inter)}.items():
        out[p + f"mlp.experts.{name}_blocks"], out[p + f"mlp.experts.{name}_scales"] = mxfp4(g, e, n, k)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a directory with tokenizer.json")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    c = dict(CONFIG, num_hidden_layers=args.layers,
             layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(args.layers)])
    (args.out / "config.json").write_text(json.dumps(c, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(args.tokenizer / name, args.out / name)
    g, index = torch.Generator().manual_seed(0), {}
    shards = [{"model.embed_tokens.weight": dense(g, c["vocab_size"], c["hidden_size"])}]
    shards += [None] * args.layers
    shards.append({"model.norm.weight": torch.ones(c["hidden_size"], dtype=torch.bfloat16),
                   "lm_head.weight": dense(g, c["vocab_size"], c["hidden_size"])})
    for s in range(len(shards)):
        tensors = shards[s] if shards[s] is not None else layer_tensors(g, s - 1, c)
        name = f"model-{s:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(args.out / name), metadata={"format": "pt"})
        index.update({t: name for t in tensors})
        shards[s] = None
    (args.out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))


if __name__ == "__main__":
    main()
