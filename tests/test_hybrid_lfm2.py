"""LFM2 (short-conv layers between attention layers) against transformers' Lfm2ForCausalLM: a tiny
random model made by transformers (eager, float32, norms and biases perturbed). The short-conv part
on a packed batch of several requests, chunks ending anywhere and decodes from shuffled state
slots; the whole decoder stepped the same way, from the safetensors directory and from a GGUF in
llama.cpp's lfm2 form; the config as transformers reads it; and, through ferry.LLM, prompt logprobs
and greedy tokens with chunked prefill, preemption and prefix caching."""
from __future__ import annotations

import json

import pytest
import torch

from ferry.model.arch.lfm2 import mlp_width
from ferry.model.config import ModelConfig
from ferry.model.kernels import kernels_usable
from tests.arch_models import random_model
from tests.gguf_lfm2 import write_gguf
from tests.hybrid_models import (E2E_PROMPTS, SHORT, SHORT_PROMPTS, assert_part_matches, decoder_diff, engine,
                                 engine_logprob_diff, first_layer_part, gguf_weights, greedy_matches, hf_greedy_all,
                                 part_outputs, rounded, skip_quantized_without_kernels)

LAYER_TYPES = ["conv", "conv", "full_attention", "conv"]
# 2/3 of 130 is 86, up to a multiple of 16: 96 (neither the configured width nor two thirds of it).
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=130, block_multiple_of=16, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
              norm_eps=1e-5, eos_token_id=319, bos_token_id=1, pad_token_id=0, layer_types=LAYER_TYPES,
              rope_parameters={"rope_type": "default", "rope_theta": 500.0})
KERNELS = [False] + ([True] if kernels_usable(torch.float32) else [])
# Three requests in packed steps: chunks end at every offset of the conv window; decodes read slots
# out of request order.
SCHEDULE, PROMPTS = SHORT, SHORT_PROMPTS


def hf_config(**over):
    from transformers import Lfm2Config

    return Lfm2Config(**{**COMMON, **over})


def make_model(path=None, **over):
    """A random LFM2 of transformers (eager, float32, norms away from 1 and biases away from 0, so a
    missed one shows), saved in ``path`` when given."""
    torch.set_rng_state(torch.Generator().get_state())  # a fixed state: the same random model each time
    return random_model(hf_config(**over), path)


def ferry_config(model) -> ModelConfig:
    return ModelConfig.from_dict(json.loads(model.config.to_json_string()))


# ---------------------------------------------------------------- the short-conv part
@pytest.mark.parametrize("use_kernel", KERNELS)
@pytest.mark.parametrize("kernel,bias", [(3, False), (4, True)])
def test_short_conv_part_matches_transformers(kernel, bias, use_kernel):
    """Three requests in packed steps (prefill chunks ending anywhere in the window, decodes from
    shuffled slots, a slot's old contents never read at a sequence's start) equal the transformers
    layer run on each whole sequence."""
    model = make_model(conv_L_cache=kernel, conv_bias=bias)
    cfg = ferry_config(model)
    layer = cfg.layers[0].recurrent
    assert (layer.kind, layer.kernel, layer.bias) == ("short_conv", kernel, bias)
    assert cfg.state_shapes(0) == {"conv": (kernel - 1, 64)}
    part = first_layer_part(cfg, dict(model.state_dict()), "short_conv", (4, 2, 16))
    assert (part.conv_bias is not None) == bias
    g = torch.Generator()  # its fixed initial state
    inputs = [torch.randn(n, 64, generator=g) for n in SCHEDULE.lengths]
    cache = {"conv": torch.randn(4, kernel - 1, 64, generator=g)}  # garbage where no request has written
    got = part_outputs(part, cfg, use_kernel, cache, inputs, SCHEDULE)
    assert_part_matches(model.model.layers[0].conv, inputs, got, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the whole decoder, stepped by hand
def test_decoder_steps_match_transformers(tmp_path):
    """Every position's logprobs, the short-conv windows and the attention's KV carried across
    chunks and decodes, equal transformers' on each whole prompt."""
    from ferry.model.loader import load_safetensors

    model = make_model(tmp_path)
    diff = decoder_diff(tmp_path, load_safetensors(tmp_path), model, PROMPTS, SCHEDULE)
    print(f"lfm2 safetensors (decoder stepped) max |d logprob| {diff:.2e}")
    assert diff < 1e-4


def quantized(name: str, t: torch.Tensor) -> bool:
    """Whether the GGUF writer quantizes this tensor: every matrix."""
    return t.ndim == 2


@pytest.mark.parametrize("quantization,qtype", [("none", "F32"), ("gguf", "F32"), ("gguf", "Q8_0")])
def test_decoder_from_a_gguf_matches_transformers(tmp_path, quantization, qtype):
    """The same weights written as llama.cpp's lfm2 GGUF: converted to a directory (none), or read
    as the file's tensors (gguf; Q8_0 matrices kept in their blocks, against transformers on the
    same weights taken to Q8_0 and back)."""
    from ferry.model.gguf_convert import convert_gguf
    from ferry.model.quant import QuantWeight

    skip_quantized_without_kernels(qtype)
    model = make_model()
    gguf = write_gguf(model, tmp_path / "lfm2.gguf", quantize=qtype)
    convert_gguf(gguf, tmp_path / "conv")
    d = json.loads((tmp_path / "conv" / "config.json").read_text())
    assert d["layer_types"] == LAYER_TYPES and d["conv_L_cache"] == 3 and d["num_key_value_heads"] == 2
    weights = gguf_weights(gguf, tmp_path / "conv", quantization)
    assert isinstance(weights["model.layers.0.conv.in_proj.weight"], QuantWeight) == (qtype != "F32")
    ref = model if qtype == "F32" else rounded(model, qtype, quantized)
    diff = decoder_diff(tmp_path / "conv", weights, ref, PROMPTS, SCHEDULE)
    print(f"lfm2 gguf ({quantization}, {qtype}, decoder stepped) max |d logprob| {diff:.2e}")
    assert diff < 1e-4


# ---------------------------------------------------------------- the config as transformers reads it
HUB_1_2B = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 65536, "hidden_size": 2048,
            "intermediate_size": 12288, "block_ff_dim": 12288, "block_auto_adjust_ff_dim": True,
            "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "conv_L_cache": 3, "conv_bias": False,
            "full_attn_idxs": [2, 5, 8, 10, 12, 14], "norm_eps": 1e-5, "rope_theta": 1e6, "tie_embedding": True,
            "max_position_embeddings": 128000, "eos_token_id": 7}


@pytest.mark.parametrize("over", [{}, {"block_ff_dim": 10000, "block_ffn_dim_multiplier": 1.3},
                                  {"block_auto_adjust_ff_dim": False, "intermediate_size": 1000,
                                   "block_ff_dim": 1000}, {"tie_embedding": False, "conv_bias": True}])
def test_the_config_reads_as_transformers_reads_it(over):
    """LFM2-1.2B's config.json (layer kinds from full_attn_idxs, the MLP's width from block_ff_dim
    adjusted, the tie flag under its old name) and variants: the widths, kinds and flags
    transformers builds; its per-request state is 10 conv layers' windows of 2 x 2048 floats."""
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    d = {**HUB_1_2B, **over}
    hf = Lfm2Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    cfg = ModelConfig.from_dict(d)
    assert cfg.intermediate_size == Lfm2MLP(hf).w1.out_features == mlp_width(d)
    assert [("conv" if layer.recurrent else "full_attention") for layer in cfg.layers] == hf.layer_types
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.head_dim) == (1e-5, 1e6, 64)
    assert all(layer.recurrent.bias == hf.conv_bias for layer in cfg.layers if layer.recurrent)
    if not over:
        assert cfg.intermediate_size == 8192 and cfg.attention_layers == [2, 5, 8, 10, 12, 14]
        assert cfg.state_floats == 10 * 2 * 2048  # 160 KiB of float32 per request


# ---------------------------------------------------------------- through the engine
# ferry.LLM with a 16-token budget cuts every prompt into chunks (ending at every offset of the conv
# window); few KV blocks force preemption; the third prompt shares the first's first 37 tokens.


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("lfm2")
    return path, make_model(path)


def test_engine_prompt_logprobs_and_greedy_tokens_match_transformers(saved):
    path, model = saved
    llm = engine(str(path))
    # Decode steps run in the fused C decode (its short-convolution op) where the kernels run.
    assert (llm.engine.executor.model.fused is not None) == kernels_usable(torch.float32)
    diff = engine_logprob_diff(llm, model, E2E_PROMPTS)
    print(f"lfm2 safetensors (engine) max |d logprob| {diff:.2e}")
    assert diff < 1e-4
    assert llm.engine.num_preemptions > 0
    greedy = hf_greedy_all(model, E2E_PROMPTS)
    for _ in range(2):  # the second time from the prefix cache's blocks and state snapshots
        greedy_matches(llm, model, E2E_PROMPTS, greedy)  # the decode steps' logprobs too
    assert llm.engine.scheduler.kv.num_hit_tokens > 0


@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_engine_from_a_gguf_matches_transformers(saved, tmp_path, monkeypatch, quantization):
    path, model = saved
    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    llm = engine(str(write_gguf(model, tmp_path / "lfm2.gguf")), quantization=quantization)
    assert llm.engine.executor.model_config.architecture == "Lfm2ForCausalLM"
    diff = engine_logprob_diff(llm, model, E2E_PROMPTS)
    print(f"lfm2 gguf ({quantization}, engine) max |d logprob| {diff:.2e}")
    assert diff < 1e-4
