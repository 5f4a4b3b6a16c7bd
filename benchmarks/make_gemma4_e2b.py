"""Write a random-weight Gemma4ForCausalLM directory of Gemma 4 E2B's published text shape (its
text_config written by hand), float16, streamed tensor by tensor in chunks so memory stays small
(the per-layer embedding alone is 262144 x 8960), with a 262144-token byte-fallback BPE tokenizer
that llama.cpp's converter reads. Usage: benchmarks/make_gemma4_e2b.py OUTDIR"""
import itertools
import json
import string
import struct
import sys
from pathlib import Path

import torch
import transformers as tf

S, F = "sliding_attention", "full_attention"
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
cfg = tf.Gemma4TextConfig(
    vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size=1536, intermediate_size=6144,
    num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
    sliding_window=512, hidden_size_per_layer_input=256, num_kv_shared_layers=20, use_double_wide_mlp=True,
    max_position_embeddings=131072, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
    final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=2, eos_token_id=1, tie_word_embeddings=True,
    layer_types=([S] * 4 + [F]) * 7,
    rope_parameters={F: {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
                     S: {"rope_theta": 1e4, "rope_type": "default"}})
cfg.architectures = ["Gemma4ForCausalLM"]
cfg.torch_dtype = "float16"
cfg.save_pretrained(out)
with torch.device("meta"):
    model = tf.Gemma4ForCausalLM(cfg)
tensors = [(n, tuple(p.shape)) for n, p in model.state_dict().items() if n != "lm_head.weight"]

# One safetensors file written by hand: its header, then each tensor's bytes chunk by chunk.
header, offset = {"__metadata__": {"format": "pt"}}, 0
for name, shape in tensors:
    size = 2 * int(torch.Size(shape).numel())
    header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
raw = json.dumps(header, separators=(",", ":")).encode()
raw += b" " * (-len(raw) % 8)
gen = torch.Generator().manual_seed(0)
CHUNK = 1 << 26
with open(out / "model.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name, shape in tensors:
        n = int(torch.Size(shape).numel())
        for start in range(0, n, CHUNK):
            k = min(CHUNK, n - start)
            if "norm" in name or name.endswith("layer_scalar"):
                t = torch.ones(k)
            else:
                t = torch.randn(k, generator=gen) * 0.02
            f.write(t.to(torch.float16).numpy().tobytes())

# The tokenizer: specials, the 256 bytes, then made-up pieces up to the vocabulary's size.
from tokenizers import Tokenizer, decoders, models, normalizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)])}
letters = string.ascii_lowercase
for width in itertools.count(1):
    for piece in itertools.product(letters, repeat=width):
        if len(vocab) >= cfg.vocab_size:
            break
        vocab["\u2581" + "".join(piece)] = len(vocab)
    if len(vocab) >= cfg.vocab_size:
        break
tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                 decoders.Strip(" ", 1, 0)])
PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                        unk_token="<unk>").save_pretrained(str(out))
print("wrote", out, offset / 2**30, "GiB of weights,", len(vocab), "tokens")
