"""Gemma 4's text model against transformers: a tiny random Gemma4ForCausalLM with sliding and global
layers (their own head sizes, the global ones' partial "proportional" rope), per-layer input
embeddings, layer scalars, double-wide MLPs and the last two layers reading the K/V of earlier ones;
prompt logprobs and greedy tokens with chunked prefill across the window, block size 4, preemption
and prefix caching. Also its KV cache (no blocks for the sharing layers), random weights and the
mixture-of-experts variant (each MLP plus routed experts) from safetensors and llama.cpp's GGUF."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ferry import LLM, SamplingParams
from tests.arch_models import hf_greedy, hf_logprobs, random_model
from tests.llama_cpp import LLAMA_CPP
from tests.test_architectures import NEW, PROMPTS, engine, max_logprob_diff

TOL = 1e-4
S, F = "sliding_attention", "full_attention"


def gemma4_config(**over):
    """Six layers: sliding 0, 1, 3, 4 (window 8, head size 16) and global 2, 5 (head size 32, a
    quarter of it rotated); layers 4 and 5 read the K/V of layers 3 and 2."""
    import transformers as tf

    c = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, global_head_dim=32, max_position_embeddings=256,
             initializer_range=0.2, eos_token_id=319, bos_token_id=1, pad_token_id=0, rms_norm_eps=1e-6,
             sliding_window=8, layer_types=[S, S, F, S, S, F], num_kv_shared_layers=2,
             hidden_size_per_layer_input=8, vocab_size_per_layer_input=320, use_double_wide_mlp=True,
             final_logit_softcapping=5.0, tie_word_embeddings=False,
             rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4},
                              F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e4}})
    return tf.Gemma4TextConfig(**dict(c, **over))


def _perturb(name: str, p: torch.Tensor) -> None:
    """Norms away from 1 and layer scalars away from 1, so a missed one shows."""
    if "norm" in name:
        p.normal_(1.0, 0.3)
    elif name.endswith("layer_scalar"):
        p.uniform_(0.5, 1.5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4")
    torch.manual_seed(0)
    model = random_model(gemma4_config(), path, _perturb, buffers=True)
    assert model.config.kv_sharing_modes == [None, None, "store", "store", "reuse", "reuse"]
    refs = [hf_logprobs(model, p) for p in PROMPTS]
    greedy = [hf_greedy(model, p, NEW) for p in PROMPTS]
    return path, model, refs, greedy


def test_gemma4_prompt_logprobs_and_greedy_tokens_match_transformers(tiny):
    path, model, refs, greedy = tiny
    llm = engine(str(path))
    assert llm.engine.executor.model.fused is not None  # its decode steps run the C ops
    diff = max_logprob_diff(llm, refs)
    print(f"gemma4 safetensors max |d logprob| {diff:.2e}")
    assert diff < TOL
    assert llm.engine.num_preemptions > 0
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=0)
    for _ in range(2):  # the second time from the prefix cache
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == greedy
        for p, g, out in zip(PROMPTS, greedy, outs):  # the decode steps' logprobs too
            ref = hf_logprobs(model, p + g)[-NEW:]
            got = torch.tensor([out.outputs[0].logprobs[j][g[j]] for j in range(NEW)])
            assert float((got - ref).abs().max()) < TOL
    assert llm.engine.scheduler.kv.num_hit_tokens > 0


def test_gemma4_decodes_in_the_fused_c_path_as_in_torch(tiny, monkeypatch):
    """Decode steps of several rows take the fused C ops (each layer's own head size, v normed, K/V
    read from earlier layers, the per-layer input block, layer scalars) and give the tokens and
    logprobs of the torch path."""
    import ferry.model.decoder as decoder

    path, model, refs, greedy = tiny
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=0)
    llm = engine(str(path))
    fused, rows = llm.engine.executor.model.fused, []
    run = fused.run
    monkeypatch.setattr(fused, "run", lambda x, *a, **k: (rows.append(x.shape[0]), run(x, *a, **k))[1])
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert rows and max(rows) > 1
    monkeypatch.setattr(decoder, "FUSED_DECODE_ROWS", 0)  # every step through torch
    torch_outs = engine(str(path)).generate(PROMPTS, sp, use_tqdm=False)
    for out, ref, g in zip(outs, torch_outs, greedy):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids == g
        got = torch.tensor([lp[t] for lp, t in zip(out.outputs[0].logprobs, g)])
        want = torch.tensor([lp[t] for lp, t in zip(ref.outputs[0].logprobs, g)])
        assert float((got - want).abs().max()) < TOL


def test_gemma4_without_the_c_kernels_matches_transformers(tiny, monkeypatch):
    """The torch path's rope (rotations made once per step) and row ops, as where no kernels load."""
    import ferry.model.decoder as decoder

    path, model, refs, greedy = tiny
    monkeypatch.setattr(decoder, "kernels_usable", lambda dtype: False)
    llm = engine(str(path))
    assert not llm.engine.executor.model.use_kernel
    diff = max_logprob_diff(llm, refs)
    print(f"gemma4 safetensors (torch row ops) max |d logprob| {diff:.2e}")
    assert diff < TOL


def test_gemma4_multimodal_checkpoint_runs_its_language_model(tmp_path):
    """Gemma4ForConditionalGeneration as published (text_config, model.language_model.*, a tied head):
    its vision tower is not read; text prompts' logprobs are transformers'."""
    import transformers as tf

    vision = tf.Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64)
    cfg = tf.Gemma4Config(text_config=gemma4_config(tie_word_embeddings=True).to_dict(),
                          vision_config=vision.to_dict(), audio_config=None)
    torch.manual_seed(0)
    model = tf.Gemma4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "language_model" in name:
                _perturb(name, p)
    model.save_pretrained(tmp_path)
    diff = max_logprob_diff(engine(str(tmp_path)), [hf_logprobs(model, p) for p in PROMPTS])
    print(f"gemma4 multimodal checkpoint max |d logprob| {diff:.2e}")
    assert diff < TOL


def test_gemma4_kv_sharing_layers_hold_the_cache_of_their_source(tiny):
    path, model, refs, greedy = tiny
    ex = LLM(model=str(path), block_size=4, num_kv_blocks=8).engine.executor
    caches = ex.kv_caches
    assert caches[4] is caches[3] and caches[5] is caches[2]
    # Only layers 0-3 keep K/V: three sliding (2 KV heads of 16) and one global (2 of 32), float32.
    assert [tuple(caches[i][0].shape) for i in range(4)] == [(32, 2, 16)] * 2 + [(32, 2, 32), (32, 2, 16)]
    owned = {c[0].untyped_storage().data_ptr() for c in caches[:4]} | {c[1].untyped_storage().data_ptr() for c in caches[:4]}
    assert len(owned) == 2  # one tensor per (KV heads, head size): no room for layers 4 and 5
    per_block = 2 * 4 * 4 * (3 * 2 * 16 + 2 * 32)
    ex = LLM(model=str(path), block_size=4, kv_cache_memory_gb=per_block * 10 / 2**30).engine.executor
    assert ex.num_kv_blocks == 10


def test_gemma4_dummy_weights_run(tmp_path):
    """From a config.json as Google's checkpoints write it: the global layers' head size in global_head_dim."""
    cfg = gemma4_config(architectures=["Gemma4ForCausalLM"]).to_dict()
    del cfg["per_layer_config"]
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, global_head_dim=32)))
    llm = LLM(model=str(tmp_path), load_format="dummy", num_kv_blocks=32)
    mc = llm.engine.executor.model_config
    assert mc.per_layer_input == 8 and [mc.kv_heads(i) for i in (1, 2)] == [(2, 16), (2, 32)]
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def _perturb_moe(name: str, p: torch.Tensor) -> None:
    """As _perturb, and the router's scales away from 1."""
    _perturb(name, p)
    if name.endswith(("router.scale", "per_expert_scale")):
        p.uniform_(0.5, 1.5)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """The six layers above with enable_moe_block: each MLP plus 4 routed experts (top 2, width 32)."""
    path = tmp_path_factory.mktemp("gemma4_moe")
    torch.manual_seed(1)
    model = random_model(gemma4_config(**MOE), path, _perturb_moe, buffers=True)
    refs = [hf_logprobs(model, p) for p in PROMPTS]
    greedy = [hf_greedy(model, p, NEW) for p in PROMPTS]
    return path, model, refs, greedy


MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


def _check_moe(llm: LLM, refs, greedy, what: str) -> None:
    """Prompt logprobs and greedy tokens (decode steps of several rows among them) are transformers'."""
    diff = max_logprob_diff(llm, refs)
    print(f"gemma4 moe {what} max |d logprob| {diff:.2e}")
    assert diff < TOL
    assert llm.engine.num_preemptions > 0
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == greedy


def test_gemma4_mixture_of_experts_matches_transformers(tiny_moe):
    path, model, refs, greedy = tiny_moe
    llm = engine(str(path))
    assert llm.engine.executor.model_config.layers[0].mlp.kind == "gemma4_moe"
    _check_moe(llm, refs, greedy, "safetensors")


def test_gemma4_mixture_of_experts_dummy_weights_run(tmp_path):
    cfg = gemma4_config(architectures=["Gemma4ForCausalLM"], **MOE).to_dict()
    del cfg["per_layer_config"]
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, global_head_dim=32)))
    llm = LLM(model=str(tmp_path), load_format="dummy", num_kv_blocks=32)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-fallback BPE tokenizer.json of ``vocab_size`` tokens (specials, the 256 bytes, letters),
    the kind llama.cpp's Gemma 4 converter reads."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)])}
    letters = "abcdefghijklmnopqrstuvwxyz"
    for t in ["\u2581"] + list(letters) + [f"\u2581{a}{b}" for a in letters for b in letters]:
        if len(vocab) < vocab_size:
            vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(str(path))


def convert_f32(model_dir: Path, model, tmp_path: Path) -> Path:
    """llama.cpp's F32 GGUF of the checkpoint in ``model_dir`` (with a tokenizer it reads)."""
    path = tmp_path / "hf"
    shutil.copytree(model_dir, path)
    write_tokenizer(path, model.config.vocab_size)
    gguf = tmp_path / "gemma4.gguf"
    env = dict(os.environ, PYTHONPATH=str(LLAMA_CPP / "gguf-py"))
    subprocess.run([sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(path), "--outtype", "f32",
                    "--outfile", str(gguf)], env=env, check=True, capture_output=True, timeout=300)
    return gguf


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(), reason="no llama.cpp source tree here")
def test_gemma4_from_llama_cpps_f32_gguf_matches_transformers(tiny, tmp_path, monkeypatch):
    """llama.cpp's converter writes the model as arch "gemma4" (the global layers' partial rotation as
    rope_freqs, double-wide MLPs as per-layer widths); kept as the file's tensors and converted."""
    model_dir, model, refs, greedy = tiny
    gguf = convert_f32(model_dir, model, tmp_path)
    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    for quant in ("gguf", "none"):
        llm = engine(str(gguf), quantization=quant)
        assert llm.engine.executor.model_config.architecture == "Gemma4ForCausalLM"
        diff = max_logprob_diff(llm, refs)
        print(f"gemma4 llama.cpp f32 gguf ({quant}) max |d logprob| {diff:.2e}")
        assert diff < TOL


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(), reason="no llama.cpp source tree here")
def test_gemma4_mixture_of_experts_from_llama_cpps_f32_gguf(tiny_moe, tmp_path, monkeypatch):
    """llama.cpp's converter keeps each layer's experts stacked (gate and up in one tensor), the
    router's scale as ffn_gate_inp.scale and the per-expert scales as ffn_down_exps.scale."""
    model_dir, model, refs, greedy = tiny_moe
    gguf = convert_f32(model_dir, model, tmp_path)
    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    for quant in ("gguf", "none"):
        _check_moe(engine(str(gguf), quantization=quant), refs, greedy, f"llama.cpp f32 gguf ({quant})")
