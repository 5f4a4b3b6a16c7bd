"""The Mamba2 hybrids against transformers: Granite 4 (GraniteMoeHybridForCausalLM: Mamba2 and
attention layers, a shared MLP, routed experts) and Nemotron-H (NemotronHForCausalLM: one block per
layer, Mamba2, attention, relu^2 MLP or sigmoid-routed experts). Tiny random models made by
transformers (eager, float32, norms and biases perturbed, the scan's decay mild enough that the
state matters). The Mamba2 part on a packed batch of several requests, prefill chunks ending
anywhere (inside a conv window, across scan chunks) and decodes from shuffled state slots; the
whole decoder stepped the same way; the published configs as transformers reads them; and, through
ferry.LLM, prompt logprobs and greedy tokens with chunked prefill, preemption and prefix caching."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from ferry.model.config import ModelConfig
from ferry.model.kernels import kernels_usable
from tests.arch_models import random_model
from tests.hybrid_models import (E2E_PROMPTS, SHORT, SHORT_PROMPTS, assert_part_matches, decoder_diff,
                                 engine_logprob_diff, first_layer_part, gguf_weights, greedy_matches, hf_greedy_all,
                                 part_outputs, rounded, skip_quantized_without_kernels)
from tests.hybrid_models import engine as hybrid_engine

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.2, eos_token_id=VOCAB - 1, bos_token_id=1,
              pad_token_id=0, tie_word_embeddings=False)
# Granite: 8 Mamba heads of 16 in 2 groups, a 16-wide state, scan chunks of 8 (prefill chunks here
# run past them); muP multipliers on the embeddings and the attention scale.
GRANITE = dict(COMMON, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"], rms_norm_eps=1e-6,
               mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2,
               mamba_chunk_size=8, intermediate_size=32, shared_intermediate_size=64, embedding_multiplier=2.5,
               attention_multiplier=0.25, residual_multiplier=0.5, logits_scaling=3.0)
KINDS = {
    "granite": dict(GRANITE, num_local_experts=4, num_experts_per_tok=2, position_embedding_type="nope"),
    "granite-dense": dict(GRANITE, num_local_experts=0, num_experts_per_tok=0, position_embedding_type="nope"),
    # Granite-4.0-Micro's shape: every layer attention, rotated (no recurrent state at all).
    "granite-rope": dict(GRANITE, layer_types=["attention"] * 4, num_local_experts=0, num_experts_per_tok=0,
                         position_embedding_type="rope", rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "nemotron": dict(COMMON, hybrid_override_pattern="M-*EM-", head_dim=16, intermediate_size=96,
                     layer_norm_epsilon=1e-5, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
                     chunk_size=8, conv_kernel=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     moe_shared_expert_intermediate_size=64, n_group=2, topk_group=1, routed_scaling_factor=2.5),
}
KINDS["nemotron-dense"] = dict(KINDS["nemotron"], hybrid_override_pattern="M-*M-M")  # Nemotron-H-8B's letters
MAMBA = {"granite": "mamba", "granite-dense": "mamba", "nemotron": "mixer"}  # the mixer's module in layer 0
KERNELS = [False] + ([True] if kernels_usable(torch.float32) else [])
# Three requests in packed steps: chunks end inside the conv window and across the scan's chunks of
# 8; decodes read slots out of request order.
SCHEDULE, PROMPTS = SHORT, SHORT_PROMPTS


def hf_config(kind: str, **over):
    import transformers as tf

    cls = tf.NemotronHConfig if kind.startswith("nemotron") else tf.GraniteMoeHybridConfig
    return cls(**{**KINDS[kind], **over})


def perturb(name: str, p: torch.Tensor) -> None:
    """Norms, biases and the scan's parameters away from their start, the decay mild enough that the
    state matters."""
    if "norm" in name:  # away from 1, so a missed or misplaced norm shows
        p.normal_(1.0, 0.3)
    elif name.endswith(("bias", "e_score_correction_bias")):
        p.normal_(0.0, 0.5)
    elif name.endswith("A_log"):  # decays of exp(-0.02) to exp(-0.5) per unit step: the state lasts
        p.copy_(torch.empty_like(p).uniform_(0.1, 0.7).log())
    elif name.endswith("dt_bias"):
        p.normal_(-1.0, 0.5)
    elif name.endswith(".D"):
        p.normal_(1.0, 0.5)


def make_model(kind: str, path=None, **over):
    """A random model of ``kind`` (eager, float32), saved in ``path`` when given (its config.json
    with num_hidden_layers, as published checkpoints carry it: transformers 5 leaves it out of
    Nemotron-H's)."""
    torch.manual_seed(0)
    model = random_model(hf_config(kind, **over), path, perturb, buffers=True)
    if path is not None:
        cfg_path = path / "config.json"
        d = json.loads(cfg_path.read_text())
        d.setdefault("num_hidden_layers", model.config.num_hidden_layers)
        cfg_path.write_text(json.dumps(d))
    return model


def hf_layers(model):
    return model.model.layers


def checkpoint(path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The saved checkpoint's tensors as the loader gives them (fused ones split)."""
    from ferry.model.loader import load_safetensors
    from ferry.model.weights import unfuse

    return unfuse(load_safetensors(path), cfg)


# ---------------------------------------------------------------- the Mamba2 part
@pytest.mark.parametrize("use_kernel", KERNELS)
@pytest.mark.parametrize("kind", ["granite", "nemotron"])
def test_mamba2_part_matches_transformers(kind, use_kernel, tmp_path):
    """Three requests in packed steps (prefill chunks continued from the slot's conv window and scan
    state, decodes from shuffled slots, a slot's old contents never read at a sequence's start)
    equal the transformers mixer run on each whole sequence."""
    model = make_model(kind, tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    spec = cfg.layers[0].recurrent
    assert (spec.kind, spec.heads, spec.head_dim, spec.d_state, spec.n_groups, spec.chunk_size) == ("mamba2", 8, 16, 16,
                                                                                                       2, 8)
    assert cfg.state_shapes(0) == {"conv": (3, 128 + 2 * 2 * 16), "ssm": (8, 16, 16)}
    part = first_layer_part(cfg, checkpoint(tmp_path, cfg), "mamba2", (4, 2, 16))
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(n, 64, generator=g) for n in SCHEDULE.lengths]
    cache = {name: torch.randn(4, *shape, generator=g) for name, shape in cfg.state_shapes(0).items()}  # garbage
    got = part_outputs(part, cfg, use_kernel, cache, inputs, SCHEDULE)
    assert_part_matches(getattr(hf_layers(model)[0], MAMBA[kind]), inputs, got, rtol=1e-4, atol=1e-5)


def test_the_scan_is_chunking_invariant():
    """The chunk-parallel scan from a state equals the one-step form token by token, whatever the
    chunk size (one chunk, several, the last one short)."""
    from ferry.model.layers.mamba2 import ssd_scan

    g = torch.Generator().manual_seed(2)
    T, H, P, N = 19, 3, 4, 5
    x, B, C = torch.randn(T, H, P, generator=g), torch.randn(T, H, N, generator=g), torch.randn(T, H, N, generator=g)
    dt, A = torch.rand(T, H, generator=g), -torch.rand(H, generator=g)
    s0 = torch.randn(H, P, N, generator=g)
    state, want = s0.clone(), []
    for t in range(T):
        state = state * torch.exp(dt[t] * A)[:, None, None] + (dt[t][:, None] * x[t])[..., None] * B[t][:, None, :]
        want.append(torch.einsum("hpn,hn->hp", state, C[t]))
    for chunk in (1, 4, 8, 32):
        y, last = ssd_scan(x, dt, A, B, C, chunk, s0)
        torch.testing.assert_close(y, torch.stack(want), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(last, state, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- the whole decoder, stepped by hand
def decoder_diff_from(model_dir, weights, model, fused: bool = False) -> float:
    """``decoder_diff`` over PROMPTS, the state caches full of garbage (the slots' old contents);
    ``fused``: its decode-only steps must run in the fused C decode."""
    return decoder_diff(model_dir, weights, model, PROMPTS, SCHEDULE, state=torch.randn, fused=fused)


# The kinds whose decode-only steps run in the fused C decode where the kernels run (Granite 4's
# experts and shared MLP in its experts op; Nemotron-H's experts have no op there).
FUSED = {"granite", "granite-dense"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_decoder_steps_match_transformers(kind, tmp_path):
    """Every position's logprobs, the conv windows, scan states and attention KV carried across
    chunks and decodes, equal transformers' on each whole prompt."""
    model = make_model(kind, tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    diff = decoder_diff_from(tmp_path, checkpoint(tmp_path, cfg), model,
                             fused=kind in FUSED and kernels_usable(torch.float32))
    print(f"{kind} safetensors (decoder stepped) max |d logprob| {diff:.2e}")
    assert diff < 1e-4


def quantized(name: str, t: torch.Tensor) -> bool:
    """Whether the GGUF writer quantizes this tensor: 2-D ones and stacked experts, not the conv."""
    return t.ndim >= 2 and "conv1d" not in name


GGUF_KINDS = ["granite", "granite-dense", "nemotron-dense"]  # llama.cpp's nemotron_h holds no experts


@pytest.mark.parametrize("quantization,qtype", [("none", "F32"), ("gguf", "F32"), ("gguf", "Q8_0")])
@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_decoder_from_a_gguf_matches_transformers(kind, quantization, qtype, tmp_path):
    """The same weights written as llama.cpp's granitehybrid / nemotron_h GGUF: converted to a
    directory (none), or read as the file's tensors (gguf; Q8_0 matrices kept in their blocks,
    against transformers on the same rounded weights)."""
    from ferry.model.gguf_convert import convert_gguf
    from ferry.model.quant import QuantWeight
    from ferry.model.weights import unfuse
    from tests.gguf_mamba2 import write_gguf

    skip_quantized_without_kernels(qtype)
    (tmp_path / "hf").mkdir()
    model = make_model(kind, tmp_path / "hf")
    gguf = write_gguf(tmp_path / "hf", tmp_path / f"{kind}.gguf", quantize=qtype)
    convert_gguf(gguf, tmp_path / "conv")
    cfg = ModelConfig.from_dir(tmp_path / "conv")
    # The same layers, but for what a GGUF does not hold (the scan's chunk: any gives the same
    # sums) or holds otherwise (experts one tensor each).
    same = lambda spec: spec and dataclasses.replace(  # noqa: E731
        spec, **{k: v for k, v in (("chunk_size", 8), ("stacked", True)) if hasattr(spec, k)})
    assert [(same(a.mixer), same(a.mlp)) for a in cfg.layers] == \
        [(same(a.mixer), same(a.mlp)) for a in ModelConfig.from_dir(tmp_path / "hf").layers]
    weights = gguf_weights(gguf, tmp_path / "conv", quantization)
    prefix = cfg.arch.layer_prefix
    in_proj = weights[f"{prefix}.0.{MAMBA.get(kind, 'mixer')}.in_proj.weight"]
    assert isinstance(in_proj, QuantWeight) == (qtype != "F32")
    ref = model if qtype == "F32" else rounded(model, qtype, quantized)
    diff = decoder_diff_from(tmp_path / "conv", unfuse(weights, cfg), ref)
    print(f"{kind} gguf ({quantization}, {qtype}, decoder stepped) max |d logprob| {diff:.2e}")
    assert diff < 1e-4


# ---------------------------------------------------------------- the configs as transformers reads them
GRANITE_LAYERS = ["mamba"] * 5 + ["attention"] + (["mamba"] * 9 + ["attention"]) * 3 + ["mamba"] * 4
# Granite-4.0-H-Tiny's and -H-Micro's config.json (ibm-granite), Nemotron-H-8B-Base-8K's (nvidia),
# trimmed to the fields that shape the model.
GRANITE_H = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "vocab_size": 100352,
             "num_hidden_layers": 40, "layer_types": GRANITE_LAYERS, "mamba_d_state": 128, "mamba_n_groups": 1,
             "mamba_d_head": 64, "mamba_d_conv": 4, "mamba_expand": 2,
             "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False, "hidden_act": "silu",
             "position_embedding_type": "nope", "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
             "max_position_embeddings": 131072, "embedding_multiplier": 12, "attention_multiplier": 0.015625,
             "residual_multiplier": 0.22, "logits_scaling": 6, "eos_token_id": 100257}
PUBLISHED = {
    "granite-4.0-h-tiny": dict(GRANITE_H, hidden_size=1536, num_attention_heads=12, num_key_value_heads=4,
                               intermediate_size=512, shared_intermediate_size=1024, num_local_experts=64,
                               num_experts_per_tok=6, mamba_n_heads=48),
    "granite-4.0-h-micro": dict(GRANITE_H, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                                intermediate_size=8192, shared_intermediate_size=8192, num_local_experts=0,
                                num_experts_per_tok=0, mamba_n_heads=64),
    "nemotron-h-8b": {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072,
                      "hidden_size": 4096, "num_hidden_layers": 52, "intermediate_size": 21504,
                      "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                      "num_attention_heads": 32, "num_key_value_heads": 8, "attention_head_dim": 128,
                      "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
                      "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": True, "use_bias": False,
                      "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "layer_norm_epsilon": 1e-5,
                      "tie_word_embeddings": False, "max_position_embeddings": 8192, "eos_token_id": 2},
}
# One request's state, float32: per Mamba2 layer the conv window (3 x (heads * head_dim + 2 * groups
# * d_state)) and the scan state (heads x head_dim x d_state).
STATE_FLOATS = {"granite-4.0-h-tiny": 36 * (3 * (48 * 64 + 2 * 128) + 48 * 64 * 128),
                "granite-4.0-h-micro": 36 * (3 * (64 * 64 + 2 * 128) + 64 * 64 * 128),
                "nemotron-h-8b": 24 * (3 * (128 * 64 + 2 * 8 * 128) + 128 * 64 * 128)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_read_as_transformers_reads_them(name):
    """The layer kinds and Mamba2 shapes transformers builds from each published config.json, and
    one request's recurrent state."""
    import transformers as tf

    d = dict(PUBLISHED[name])
    hf_cls = tf.NemotronHConfig if d["model_type"] == "nemotron_h" else tf.GraniteMoeHybridConfig
    hf = hf_cls(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    if "residual_multiplier" in d:  # refused for now (the next test): they need decoder fields
        d.update(residual_multiplier=1.0, logits_scaling=1.0)
    cfg = ModelConfig.from_dict(d)
    kinds = ["linear_attention" if layer.recurrent else "full_attention" if layer.attention else
             ("moe" if layer.mlp.kind == "sigmoid_experts" else "mlp") for layer in cfg.layers]
    assert kinds == list(hf.layer_types)
    spec = cfg.layers[cfg.recurrent_layers[0]].recurrent
    heads = getattr(hf, "mamba_n_heads", None) or hf.mamba_num_heads
    head_dim = getattr(hf, "mamba_d_head", None) or hf.mamba_head_dim
    assert (spec.heads, spec.head_dim, spec.inner) == (heads, head_dim, heads * head_dim)
    assert cfg.state_floats == STATE_FLOATS[name]
    print(f"{name}: {len(cfg.recurrent_layers)} Mamba2 layers, {cfg.state_floats} floats "
          f"({cfg.state_floats * 4 / 2 ** 20:.1f} MiB) of state per request")


def test_granite_multipliers_are_read():
    """Granite's residual and logit multipliers (the tiny models run with 0.5 and 3: the parity
    tests above check them) become the decoder's residual scale and logit divisor."""
    cfg = ModelConfig.from_dict(json.loads(hf_config("granite", residual_multiplier=0.22, logits_scaling=6.0)
                                           .to_json_string()))
    assert (cfg.residual_scale, cfg.logits_divisor) == (0.22, 6.0)
    assert math.isinf(ModelConfig.from_dict(json.loads(hf_config("granite").to_json_string())).layers[0]
                      .recurrent.dt_limit[1])


# ---------------------------------------------------------------- through the engine
def engine(model: str, **kw):
    """A 16-token budget cuts every prompt into chunks (ending inside conv windows and scan chunks);
    few KV blocks force preemption; the third prompt shares the first's first 37 tokens; the state
    is kept for the prefix cache every 12 tokens (chunks end there, off the scan's chunks of 8)."""
    return hybrid_engine(model, state_snapshot_interval=12, **kw)


@pytest.fixture(scope="module", params=list(KINDS))
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_model(request.param, path)


def test_engine_prompt_logprobs_and_greedy_tokens_match_transformers(saved):
    """Several prompts in one generate call: prompt logprobs, greedy tokens and the decode steps'
    logprobs equal transformers', with preemption, and again from the prefix cache."""
    kind, path, model = saved
    llm = engine(str(path))
    worst = engine_logprob_diff(llm, model, E2E_PROMPTS)
    print(f"{kind} safetensors (engine) max |d logprob| {worst:.2e}")
    assert worst < 1e-4
    assert llm.engine.num_preemptions > 0
    greedy = hf_greedy_all(model, E2E_PROMPTS)
    for _ in range(2):  # all at once, preempting each other
        greedy_matches(llm, model, E2E_PROMPTS, greedy)
    hits = llm.engine.scheduler.kv.num_hit_tokens
    # One at a time: the first prompt's state kept every 12 tokens, the third starts from its
    # snapshot at 36 (the blocks they share), the first again from its own at 44.
    for i in (0, 2, 0):
        greedy_matches(llm, model, [E2E_PROMPTS[i]], [greedy[i]])
    assert llm.engine.scheduler.kv.num_hit_tokens - hits >= 36 + 44


@pytest.mark.parametrize("quantization", ["none", "gguf"])
@pytest.mark.parametrize("kind", ["granite", "nemotron-dense"])
def test_engine_from_a_gguf_matches_transformers(kind, quantization, tmp_path, monkeypatch):
    """The model as llama.cpp's GGUF through ferry.LLM: converted (none) or kept as the file's
    tensors (gguf), prompt logprobs as transformers'."""
    from tests.gguf_mamba2 import write_gguf

    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    (tmp_path / "hf").mkdir()
    model = make_model(kind, tmp_path / "hf")
    llm = engine(str(write_gguf(tmp_path / "hf", tmp_path / f"{kind}.gguf")), quantization=quantization)
    assert llm.engine.executor.model_config.architecture == model.config.architectures[0]
    worst = engine_logprob_diff(llm, model, E2E_PROMPTS)
    print(f"{kind} gguf ({quantization}, engine) max |d logprob| {worst:.2e}")
    assert worst < 1e-4
