"""A model with Qwen3-VL-2B-Instruct's shape and random weights, for side-by-side image timings.

Writes ``OUT/hf`` (Qwen3VLForConditionalGeneration from Qwen3-VL-2B-Instruct's published
config.json, bfloat16, SmolLM2's tokenizer plus Qwen's vision tokens, the vocabulary padded to
Qwen's 151,936 rows, Qwen's image processor rules), then llama.cpp's pair from it: the text GGUF
(F16, then Q4_K_M by ``llama-quantize``) and the ``--mmproj`` GGUF of the vision tower (F16).

    python benchmarks/make_qwen3_vl_2b.py --llama-cpp $LLAMA_CPP --out models/qwen3-vl-2b-shape
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

# Qwen3-VL-2B-Instruct's config.json (text and vision towers), as published.
TEXT = dict(attention_bias=False, head_dim=128, hidden_act="silu", hidden_size=2048, initializer_range=0.02,
            intermediate_size=6144, max_position_embeddings=262144, num_attention_heads=16, num_hidden_layers=28,
            num_key_value_heads=8, rms_norm_eps=1e-6, tie_word_embeddings=True, vocab_size=151936,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                             "mrope_interleaved": True})
VISION = dict(deepstack_visual_indexes=[5, 11, 17], depth=24, hidden_act="gelu_pytorch_tanh", hidden_size=1024,
              in_channels=3, initializer_range=0.02, intermediate_size=4096, num_heads=16,
              num_position_embeddings=2304, out_hidden_size=2048, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2)
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]

# The converter without a tokenizer.model: its Qwen vocabulary path falls through to the BPE one.
RUN_CONVERTER = """import os, runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
from conversion import base
_orig = base.TextModel._create_vocab_sentencepiece
def _create(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return _orig(self)
base.TextModel._create_vocab_sentencepiece = _create
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def make_hf(path: Path) -> None:
    """The checkpoint directory: random bfloat16 weights, tokenizer, image processor config."""
    import transformers as tf

    from ferry.model.loader import resolve_model_dir

    tok = tf.AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    start, pad, end, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    cfg = tf.Qwen3VLConfig(text_config=dict(TEXT, eos_token_id=tok.eos_token_id), vision_config=VISION,
                           image_token_id=pad, video_token_id=video, vision_start_token_id=start,
                           vision_end_token_id=end, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = tf.Qwen3VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    tok.save_pretrained(str(path))
    # Qwen3-VL's preprocessor_config.json: 16-pixel patches merged 2x2, CLIP-style 0.5 normalisation.
    tf.Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5],
                             image_std=[0.5, 0.5, 0.5],
                             size={"shortest_edge": 65536, "longest_edge": 16777216}).save_pretrained(str(path))


def convert(llama_cpp: Path, model_dir: Path, out: Path, outtype: str, mmproj: bool = False) -> None:
    env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
    cmd = [sys.executable, "-c", RUN_CONVERTER, str(llama_cpp / "convert_hf_to_gguf.py"), str(model_dir),
           "--outtype", outtype, "--outfile", str(out)] + (["--mmproj"] if mmproj else [])
    subprocess.run(cmd, env=env, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree (built: build/bin)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    hf, gguf = args.out / "hf", args.out / "gguf"
    gguf.mkdir(parents=True, exist_ok=True)
    if not (hf / "config.json").is_file():
        hf.mkdir(parents=True, exist_ok=True)
        make_hf(hf)
    f16 = gguf / "qwen3-vl-2b-shape-F16.gguf"
    if not f16.is_file():
        convert(args.llama_cpp, hf, f16, "f16")
    mmproj = gguf / "mmproj-qwen3-vl-2b-shape-F16.gguf"
    if not mmproj.is_file():
        convert(args.llama_cpp, hf, mmproj, "f16", mmproj=True)
    q4 = gguf / "qwen3-vl-2b-shape-Q4_K_M.gguf"
    if not q4.is_file():
        subprocess.run([str(args.llama_cpp / "build" / "bin" / "llama-quantize"), str(f16), str(q4), "Q4_K_M", "2"],
                       check=True)
    print(f"text {q4}\nmmproj {mmproj}")


if __name__ == "__main__":
    main()
