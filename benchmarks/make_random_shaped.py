"""Write a random-weight HF directory of a published model's shape (config via transformers, tensors
written shard by shard in float16 so memory stays at one shard). Usage: benchmarks/make_random_shaped.py {smollm2-1.7b|qwen3-4b|qwen3.5-0.8b} OUTDIR"""
import json
import shutil
import sys
from pathlib import Path

import torch
import transformers as tf
from safetensors.torch import save_file

from ferry.model.loader import resolve_model_dir

TOK = resolve_model_dir(None)  # the embedded model's converted directory: its tokenizer files

which, out = sys.argv[1], Path(sys.argv[2])
if which == "smollm2-1.7b":
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=130000, rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=2)
    cls = tf.LlamaForCausalLM
elif which == "qwen3-4b":
    cfg = tf.Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                         max_position_embeddings=40960, rope_theta=1000000, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=2)
    cls = tf.Qwen3ForCausalLM
elif which == "qwen3.5-0.8b":
    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * 6
    cfg = tf.Qwen3_5TextConfig(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                               layer_types=layer_types, full_attention_interval=4, linear_conv_kernel_dim=4,
                               linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                               linear_num_value_heads=16, max_position_embeddings=262144, rms_norm_eps=1e-6,
                               tie_word_embeddings=True, attn_output_gate=True, bos_token_id=1, eos_token_id=2,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000000,
                                                "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                                "mrope_section": [11, 11, 10]})
    cls = tf.Qwen3_5ForCausalLM
else:
    raise SystemExit(f"unknown shape {which}")

out.mkdir(parents=True, exist_ok=True)
with torch.device("meta"):
    model = cls(cfg)
cfg.architectures = [cls.__name__]
cfg.torch_dtype = "float16"
cfg.save_pretrained(out)
gen = torch.Generator().manual_seed(0)
shard, size, n, index = {}, 0, 0, {}


def flush():
    global shard, size, n
    if shard:
        name = f"model-{n:05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        for k in shard:
            index[k] = name
        shard, size, n = {}, 0, n + 1


for name, p in model.state_dict().items():
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        continue
    if name.endswith("A_log"):
        t = torch.log(torch.empty(p.shape).uniform_(1, 16, generator=gen))
    elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        t = torch.ones(p.shape)
    elif "norm" in name:
        t = torch.ones(p.shape) if which != "qwen3.5-0.8b" else torch.zeros(p.shape)  # Qwen3.5's norms are 1 + w
    else:
        t = torch.randn(p.shape, generator=gen) * 0.02
    shard[name] = t.to(torch.float16).contiguous()
    size += shard[name].numel() * 2
    if size > 1 << 30:
        flush()
flush()
(out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(TOK / f, out / f)
print("wrote", out, n, "shards")
