"""Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet layers between gated full-attention layers) against
transformers' Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM: tiny random models made by transformers
(eager, float32, norms and biases perturbed). The chunk-parallel delta rule against its recurrence;
the DeltaNet part on a packed batch of several requests (chunks longer than the delta rule's block,
chunks from a carried state, decodes from shuffled state slots); the whole decoder stepped the same
way, from the safetensors directory and from a GGUF in llama.cpp's qwen35 / qwen35moe form; the
config as transformers reads it; and, through ferry.LLM, prompt logprobs and greedy tokens with
chunked prefill, preemption and prefix caching."""
from __future__ import annotations

import json

import pytest
import torch

from ferry.model.arch.qwen3_5 import layer_types
from ferry.model.config import ModelConfig
from ferry.model.kernels import kernels_usable
from ferry.model.layers.gated_deltanet import CHUNK, chunk_delta_rule, recurrent_step
from tests.arch_models import random_model
from tests.hybrid_models import (E2E_PROMPTS, Schedule, assert_part_matches, decoder_diff, engine,
                                 engine_logprob_diff, first_layer_part, gguf_weights, greedy_matches, hf_greedy_all,
                                 part_outputs, rounded, skip_quantized_without_kernels)

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
# Small weights (initializer_range 0.05): with transformers' 0.2 this model's float32 results move by
# ~5e-3 in logprob between transformers' own one-pass and cached runs, hiding a 1e-4 comparison.
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.05,
              rms_norm_eps=1e-6, eos_token_id=319, bos_token_id=1, tie_word_embeddings=False,
              layer_types=LAYER_TYPES, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_num_key_heads=2, linear_num_value_heads=4,
              rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25})
# (transformers' MoE config has no intermediate_size: its config.json keeps COMMON's, which
# ModelConfig.from_dict requires.)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40)
KINDS = ["dense", "moe"]
KERNELS = [False] + ([True] if kernels_usable(torch.float32) else [])


def hf_config(kind: str = "dense", **over):
    import transformers as tf

    if kind == "moe":
        return tf.Qwen3_5MoeTextConfig(**{**COMMON, **MOE, **over})
    return tf.Qwen3_5TextConfig(**{**COMMON, **over})


def perturb(name: str, p: torch.Tensor) -> None:
    """Norms away from identity and biases away from their start, so a missed one shows."""
    if name.endswith("linear_attn.norm.weight"):  # the gated norm: plain w
        p.normal_(1.0, 0.3)
    elif "norm" in name:  # the (1 + w) norms
        p.normal_(0.0, 0.3)
    elif name.endswith("bias"):  # dt_bias
        p.normal_(0.0, 0.5)


def make_model(kind: str = "dense", path=None, **over):
    """A random Qwen3.5 (or -MoE) of transformers (eager, float32), saved in ``path`` when given."""
    torch.manual_seed(0)
    return random_model(hf_config(kind, **over), path, perturb)


def ferry_config(model) -> ModelConfig:
    return ModelConfig.from_dict(json.loads(model.config.to_json_string()))


# ---------------------------------------------------------------- the delta rule's two forms
def test_the_chunked_delta_rule_equals_its_recurrence():
    """From a carried state, over three blocks of CHUNK tokens and a partial one, the chunk-parallel
    form gives the token-by-token recurrence's outputs and final state (float64)."""
    g = torch.Generator().manual_seed(0)
    H, T, dk, dv = 3, 2 * CHUNK + 37, 8, 12
    q, k = (torch.nn.functional.normalize(torch.randn(H, T, dk, generator=g, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(H, T, dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(H, T, generator=g, dtype=torch.float64) * 2
    beta = torch.rand(H, T, generator=g, dtype=torch.float64)
    state = torch.randn(H, dk, dv, generator=g, dtype=torch.float64)
    got, got_state = chunk_delta_rule(q, k, v, decay, beta, state)
    s, outs = state[None], []
    for t in range(T):
        o, s = recurrent_step(q[None, :, t], k[None, :, t], v[None, :, t], decay[None, :, t], beta[None, :, t], s)
        outs.append(o[0])
    torch.testing.assert_close(got, torch.stack(outs, dim=1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_state, s[0], rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- a step schedule without the engine
# Chunks longer than CHUNK from zeros and from a carried state, chunks ending inside a block and inside
# the conv window; decodes read state slots out of request order (slot 1 is never used, its garbage
# never read); each request's KV positions in one block of 256 of its own.
SCHEDULE = Schedule(steps=[[("p", 0, 20), ("p", 1, 70)],
                           [("p", 0, 100), ("p", 1, 3), ("p", 2, 30)],
                           [("d", 2), ("d", 1), ("p", 0, 30)],
                           [("d", 1), ("d", 0), ("p", 2, 9)],
                           [("d", 2), ("d", 0), ("d", 1)],
                           [("d", 0), ("p", 1, 70)]],
                    lengths=[153, 146, 41], slots=[2, 0, 3], block=256)


# ---------------------------------------------------------------- the DeltaNet part
@pytest.mark.parametrize("use_kernel", KERNELS)
def test_deltanet_part_matches_transformers(use_kernel):
    """Three requests in packed steps (chunks across the delta rule's blocks, from zeros and from
    carried states, decodes from shuffled slots, a slot's old contents never read at a sequence's
    start) equal the transformers layer run on each whole sequence."""
    model = make_model()
    cfg = ferry_config(model)
    spec = cfg.layers[0].recurrent
    assert (spec.kind, spec.k_heads, spec.v_heads, spec.k_dim, spec.v_dim, spec.conv_kernel) == \
        ("gated_deltanet", 2, 4, 8, 12, 4)
    assert cfg.state_shapes(0) == {"conv": (3, 2 * 2 * 8 + 4 * 12), "ssm": (4, 8, 12)}
    part = first_layer_part(cfg, dict(model.state_dict()), "gated_deltanet", (4, 2, 32))
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(n, 64, generator=g) for n in SCHEDULE.lengths]
    cache = {n: torch.randn(4, *s, generator=g) for n, s in cfg.state_shapes(0).items()}  # garbage nobody wrote
    got = part_outputs(part, cfg, use_kernel, cache, inputs, SCHEDULE)
    assert_part_matches(model.model.layers[0].linear_attn, inputs, got, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- the whole decoder, stepped by hand
PROMPTS = [[(a * i + b) % 300 + 2 for i in range(n)]
           for n, (a, b) in zip(SCHEDULE.lengths, [(7, 3), (11, 5), (13, 1)])]


@pytest.mark.parametrize("use_kernel", KERNELS)
@pytest.mark.parametrize("kind", KINDS)
def test_decoder_steps_match_transformers(tmp_path, kind, use_kernel):
    """Every position's logprobs (the DeltaNet states and conv windows, and the gated attention's KV
    with its quarter-head rope, carried across chunks and decodes) equal transformers' on each
    whole prompt."""
    from ferry.model.loader import load_safetensors

    model = make_model(kind, tmp_path)
    # With the kernels, decode-only steps run the fused C decode (the MoE's experts and shared expert too).
    diff = decoder_diff(tmp_path, load_safetensors(tmp_path), model, PROMPTS, SCHEDULE, use_kernel=use_kernel,
                        fused=use_kernel)
    print(f"qwen3.5 {kind} safetensors (decoder stepped, kernels {use_kernel}) max |d logprob| {diff:.2e}")
    assert diff < 1e-4


# ---------------------------------------------------------------- from a GGUF in llama.cpp's form
# Value heads as wide as a Q8_0 block: llama.cpp's reorder of out_proj's columns then moves whole
# blocks, so transformers on weights rounded in its own order is the reference; a shared expert of
# whole blocks too.
GGUF_OVER = {"dense": {"linear_value_head_dim": 32},
             "moe": {"linear_value_head_dim": 32, "shared_expert_intermediate_size": 64}}
FLOAT_KEPT = ("mlp.gate.weight", "mlp.shared_expert_gate.weight", "linear_attn.conv1d.weight")


def quantized(name: str, t: torch.Tensor) -> bool:
    """Whether the GGUF writer quantizes this tensor: every matrix but the router gates and the conv."""
    return t.ndim >= 2 and not name.endswith(FLOAT_KEPT)


@pytest.mark.parametrize("quantization,qtype", [("none", "F32"), ("gguf", "F32"), ("gguf", "Q8_0")])
@pytest.mark.parametrize("kind", KINDS)
def test_decoder_from_a_gguf_matches_transformers(tmp_path, kind, quantization, qtype):
    """The same weights written as llama.cpp's qwen35 / qwen35moe GGUF (value heads in its tiled
    order, A_log as -exp(A_log), the conv squeezed, 1 + w norms): converted to a directory (none), or
    read as the file's tensors (gguf; Q8_0 matrices kept in their blocks, against transformers on the
    same rounded weights)."""
    from ferry.model.gguf_convert import convert_gguf
    from ferry.model.quant import QuantWeight
    from tests.gguf_qwen3_5 import write_gguf

    skip_quantized_without_kernels(qtype)
    model = make_model(kind, **GGUF_OVER[kind])
    gguf = write_gguf(model, tmp_path / f"{kind}.gguf", quantize=qtype)
    convert_gguf(gguf, tmp_path / "conv")
    d = json.loads((tmp_path / "conv" / "config.json").read_text())
    assert d["layer_types"] == LAYER_TYPES and d["linear_value_head_order"] == "tiled"
    assert d["partial_rotary_factor"] == 0.25 and d["linear_num_value_heads"] == 4
    weights = gguf_weights(gguf, tmp_path / "conv", quantization)
    assert isinstance(weights["model.layers.0.linear_attn.in_proj_qkv.weight"], QuantWeight) == (qtype != "F32")
    ref = model if qtype == "F32" else rounded(model, qtype, quantized)
    diff = decoder_diff(tmp_path / "conv", weights, ref, PROMPTS, SCHEDULE)
    print(f"qwen3.5 {kind} gguf ({quantization}, {qtype}, decoder stepped) max |d logprob| {diff:.2e}")
    assert diff < 1e-4


# ---------------------------------------------------------------- the config as transformers reads it
# Qwen3.5-0.8B's text config (its layer kinds from full_attention_interval).
HUB_0_8B = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320,
            "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
            "full_attention_interval": 4, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "max_position_embeddings": 262144, "eos_token_id": 248044,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                "mrope_interleaved": True, "mrope_section": [11, 11, 10]}}


def test_the_config_reads_as_transformers_reads_it():
    """Qwen3.5-0.8B's config.json: the layer kinds and DeltaNet shapes transformers builds, a quarter
    of each attention head rotated; its per-request state is 18 DeltaNet layers' conv windows
    (3 x 6144) and 16 [128, 128] matrices, about 19.3 MiB of float32."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    d = dict(HUB_0_8B)
    hf = Qwen3_5TextConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    cfg = ModelConfig.from_dict(d)
    assert layer_types(d) == hf.layer_types
    assert [("linear_attention" if layer.recurrent else "full_attention") for layer in cfg.layers] == hf.layer_types
    assert cfg.attention_layers == [3, 7, 11, 15, 19, 23]
    net = Qwen3_5GatedDeltaNet(hf, 0)
    spec = cfg.layers[0].recurrent
    assert spec.conv_dim == net.conv_dim and cfg.state_shapes(0)["ssm"] == (net.num_v_heads, net.head_k_dim, net.head_v_dim)
    attn = cfg.layers[3].attention
    assert (attn.rotary_dim, attn.output_gate, attn.qk_norm, attn.rope) == (64, True, True, (1e7, None))
    assert cfg.state_floats == 18 * (3 * 6144 + 16 * 128 * 128)
    assert round(cfg.state_floats * 4 / 2 ** 20, 1) == 19.3


def test_layer_kinds_come_from_the_interval_or_the_list():
    assert layer_types({"num_hidden_layers": 6, "full_attention_interval": 3}) == \
        ["linear_attention", "linear_attention", "full_attention"] * 2
    with pytest.raises(ValueError, match="layer_types"):
        layer_types({"num_hidden_layers": 2, "layer_types": ["linear_attention", "sliding_attention"]})


# ---------------------------------------------------------------- through the engine
# ferry.LLM (tests.hybrid_models.engine): a 16-token budget cuts every prompt into chunks; few KV
# blocks force preemption; the third of E2E_PROMPTS shares the first's first 37 tokens.
LONG_PROMPTS = [[(5 * i + 1) % 300 + 2 for i in range(150)], [(13 * i + 7) % 300 + 2 for i in range(90)]]
@pytest.fixture(scope="module", params=KINDS)
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"qwen3_5_{request.param}")
    return request.param, path, make_model(request.param, path)


def test_engine_prompt_logprobs_and_greedy_tokens_match_transformers(saved):
    kind, path, model = saved
    llm = engine(str(path))
    assert llm.engine.executor.model_config.architecture == model.config.architectures[0]
    diff = engine_logprob_diff(llm, model, E2E_PROMPTS)
    print(f"qwen3.5 {kind} safetensors (engine) max |d logprob| {diff:.2e}")
    assert diff < 1e-4
    assert llm.engine.num_preemptions > 0
    greedy = hf_greedy_all(model, E2E_PROMPTS)
    for _ in range(2):  # the second time from the prefix cache's blocks and state snapshots
        greedy_matches(llm, model, E2E_PROMPTS, greedy)
    assert llm.engine.scheduler.kv.num_hit_tokens > 0


def test_engine_long_prompts_in_long_chunks_match_transformers(saved):
    """Prompts of 150 and 90 tokens in chunks of up to 128: the delta rule's blocks of CHUNK tokens
    inside a chunk, and a chunk starting from the state the one before left."""
    kind, path, model = saved
    llm = engine(str(path), budget=128, blocks=128)
    diff = engine_logprob_diff(llm, model, LONG_PROMPTS)
    print(f"qwen3.5 {kind} safetensors (engine, long prompts) max |d logprob| {diff:.2e}")
    assert diff < 1e-4
    greedy_matches(llm, model, LONG_PROMPTS, hf_greedy_all(model, LONG_PROMPTS))


@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_engine_from_a_gguf_matches_transformers(saved, tmp_path, monkeypatch, quantization):
    from tests.gguf_qwen3_5 import write_gguf

    kind, path, model = saved
    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    llm = engine(str(write_gguf(model, tmp_path / f"{kind}.gguf")), quantization=quantization)
    assert llm.engine.executor.model_config.architecture == model.config.architectures[0]
    diff = engine_logprob_diff(llm, model, E2E_PROMPTS)
    print(f"qwen3.5 {kind} gguf ({quantization}, engine) max |d logprob| {diff:.2e}")
    assert diff < 1e-4


def test_the_published_multimodal_checkpoint_runs_as_its_language_model(tmp_path):
    """Qwen3.5 is published as Qwen3_5ForConditionalGeneration: the language model's fields in
    text_config and its tensors under model.language_model.; ferry runs its text and reads nothing
    of the vision tower."""
    import transformers as tf

    from ferry.model.loader import load_safetensors

    torch.manual_seed(0)
    text = {k: v for k, v in COMMON.items() if k != "tie_word_embeddings"}
    config = tf.Qwen3_5Config(text_config=text, tie_word_embeddings=False,
                              vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                 out_hidden_size=64))
    model = tf.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "visual" not in name and not name.endswith("linear_attn.norm.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.architecture == "Qwen3_5ForConditionalGeneration" and cfg.hidden_size == 64
    assert not [k for k in load_safetensors(tmp_path, cfg.arch.skip_prefixes) if "visual" in k]
    llm = engine(str(tmp_path))
    diff = engine_logprob_diff(llm, model, E2E_PROMPTS)
    print(f"qwen3.5 multimodal checkpoint (engine, text) max |d logprob| {diff:.2e}")
    assert diff < 1e-4
