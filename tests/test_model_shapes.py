"""Llama-family shapes (GQA, untied, qkv bias, rope_theta) load from safetensors and match transformers."""
from __future__ import annotations

import json

import pytest
import torch

from ferry import LLM, SamplingParams


def tiny(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, rope_theta=500.0, eos_token_id=299, bos_token_id=1)
    if kind == "llama-untied":
        return LlamaConfig(tie_word_embeddings=False, **common)
    if kind == "qwen2-bias":
        return Qwen2Config(tie_word_embeddings=True, **common)
    return MistralConfig(tie_word_embeddings=False, sliding_window=None, **common)


@pytest.mark.parametrize("kind", ["llama-untied", "qwen2-bias", "mistral"])
def test_tiny_random_model_matches_transformers(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny(kind), dtype=torch.float32).eval()
    if kind == "qwen2-bias":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    prompts = [[5, 17, 42, 7, 99], list(range(10, 60))]
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                                 do_sample=False, pad_token_id=0)
            refs.append(gen[0, len(p):].tolist())
    llm = LLM(model=str(tmp_path), max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, min_tokens=16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_dummy_weights_from_config_alone(tmp_path):
    cfg = tiny("llama-untied").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(tmp_path), load_format="dummy")
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLM(model=str(tmp_path))


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(model=str(tmp_path))


def test_bfloat16_runs_on_the_embedded_model():
    llm = LLM(dtype="bfloat16", kv_cache_memory_gb=0.25)
    assert llm.engine.executor.kv_caches[0][0].dtype == torch.bfloat16
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_a_gguf_tokenizer_splits_as_llama_cpp_does(embedded_dir):
    """The embedded GGUF's `tokenizer.ggml.pre` is "smollm": digits split one by one before the
    byte-level expression, as llama.cpp and SmolLM2's own tokenizer.json do. The ids are
    llama-server's /tokenize of the same text (a plain byte-level split gives 198, 198 for "\\n\\n")."""
    from ferry.model.tokenizer import Tokenizer

    tok = Tokenizer(embedded_dir)
    assert tok.encode(" following requirements:\n\n1. Explicit") == [1695, 4292, 42, 1116, 33, 30, 1323, 12962]
    assert tok.encode("In 2024, 12 ferries") == tok.encode("In 2024,") + tok.encode(" 12 ferries")
    assert len(tok.encode("2024")) == 4
