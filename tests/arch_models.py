"""Tiny random models made by transformers itself, and the same weights written as a GGUF with the
gguf library's writer under llama.cpp's tensor and metadata names (a test helper)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, eos_token_id=VOCAB - 1,
              bos_token_id=1, tie_word_embeddings=False, rms_norm_eps=1e-6)


def rope(kind: str) -> dict[str, Any]:
    """Llama 3.x-style rope parameters, scaled so that tiny prompts (past 32 positions) feel it."""
    base = {"rope_theta": 500.0, "rope_type": kind}
    if kind == "llama3":
        return dict(base, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    if kind == "yarn":
        return dict(base, factor=4.0, original_max_position_embeddings=64)
    if kind in ("linear", "dynamic"):
        return dict(base, factor=2.0)
    return base


def hf_config(kind: str):
    """The transformers config of one test model: llama-<rope kind>, qwen3, or mistral (window 8)."""
    import transformers as tf

    if kind.startswith("llama"):
        return tf.LlamaConfig(rope_parameters=rope(kind.split("-", 1)[1]), **COMMON)
    if kind == "qwen2":
        return tf.Qwen2Config(rope_parameters=rope("default"), **COMMON)
    if kind == "qwen3":
        return tf.Qwen3Config(head_dim=24, rope_parameters=rope("default"), **COMMON)
    if kind == "mistral":
        return tf.MistralConfig(sliding_window=8, rope_parameters=rope("default"), **COMMON)
    if kind.startswith("gemma3"):  # layers 0-2 windowed (base 10000), layer 3 global (base 1e6, linear scaling)
        # gemma3-gguf: the attention scale llama.cpp computes (1/sqrt(head_dim)), which its files cannot change.
        c = dict(COMMON, num_hidden_layers=4)
        return tf.Gemma3TextConfig(head_dim=16, query_pre_attn_scalar=16 if kind == "gemma3-gguf" else 24,
                                   sliding_window=8,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1e6}},
                                   final_logit_softcapping=5.0, **c)
    if kind == "phi3":  # longrope (short factors within the original 64 positions, and its attention factor)
        hd = COMMON["hidden_size"] // COMMON["num_attention_heads"]
        c = dict(COMMON, max_position_embeddings=128)
        rp = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0 + 0.1 * i for i in range(hd // 2)],
              "long_factor": [1.0 + 0.5 * i for i in range(hd // 2)], "original_max_position_embeddings": 64}
        return tf.Phi3Config(rope_parameters=rp, original_max_position_embeddings=64, pad_token_id=0, **c)
    if kind == "qwen3-moe":
        c = dict(COMMON, num_hidden_layers=3)
        return tf.Qwen3MoeConfig(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                 norm_topk_prob=True, mlp_only_layers=[1], rope_parameters=rope("default"), **c)
    if kind == "gpt-oss":  # windowed (8) and full layers alternating, YaRN untruncated, 4 experts (top 2)
        rp = dict(rope("yarn"), beta_fast=32.0, beta_slow=1.0, truncate=False)
        return tf.GptOssConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                               rope_parameters=rp, **dict(COMMON, num_hidden_layers=3, intermediate_size=32))
    if kind == "smollm3":  # layers 0-2 rotate, layer 3 does not
        return tf.SmolLM3Config(rope_parameters=rope("default"), pad_token_id=0, **dict(COMMON, num_hidden_layers=4))
    raise KeyError(kind)


def make_model(kind: str, path: Path):
    """A random model of ``kind`` saved in ``path`` (eager attention, float32), returned in eval mode."""
    torch.manual_seed(0)
    return random_model(hf_config(kind), path, perturb_gpt_oss if kind == "gpt-oss" else perturb_norms_and_biases)


def perturb_gpt_oss(name: str, p: torch.Tensor) -> None:
    """Norms and biases perturbed, and the experts' gate_up weights 5x, so that their clamp (7.0)
    cuts some gate and up values."""
    perturb_norms_and_biases(name, p)
    if name.endswith("experts.gate_up_proj"):
        p.mul_(5.0)


def perturb_norms_and_biases(name: str, p: torch.Tensor) -> None:
    """Norms away from 1 and biases away from 0 (Qwen2's q/k/v biases start at zero), so a missed or
    misplaced one shows."""
    if "norm" in name:
        p.normal_(1.0, 0.3)
    elif name.endswith("bias"):
        p.normal_(0.0, 0.5)


def random_model(config, path: Path | None = None,
                 perturb: Callable[[str, torch.Tensor], None] = perturb_norms_and_biases, buffers: bool = False):
    """transformers' model for ``config`` (eager attention, float32, eval mode) drawn from the torch
    generator as it stands, then ``perturb(name, tensor)`` on each parameter (and buffer, with
    ``buffers``); saved in ``path`` when given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + (list(model.named_buffers()) if buffers else []):
            perturb(name, p)
    if path is not None:
        model.save_pretrained(path)
    return model


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """q or k rows in llama.cpp's llama layout (its LlamaModel.permute): each head's rows as
    interleaved (even, odd) pairs instead of two halves."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          # Phi-3's fused tensors, kept fused; a mixture's router.
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp"}
# Gemma 3's norms under llama.cpp's names (its "ffn_norm" is the norm before the MLP).
_GEMMA_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
             "phi3": "phi3", "qwen3_moe": "qwen3moe", "smollm3": "smollm3", "gpt_oss": "gpt-oss"}
# gpt-oss under llama.cpp's names (its norm before the MLP is "post_attention_norm"; sinks carry ".weight").
_GPT_OSS_LAYER = {"post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}
PERMUTED = ("llama", "smollm3")  # llama.cpp's "normal" rope: q/k rows interleaved


def _add_rope(w, gguf, cfg, rp: dict, hd: int) -> None:
    w.add_rope_freq_base(rp["rope_theta"])
    kind = rp.get("rope_type", "default")
    if kind in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        if kind == "yarn":
            w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    if kind == "llama3":  # llama.cpp keeps llama3 scaling as per-frequency divisors
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")[0]
        base = 1.0 / (rp["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        w.add_tensor("rope_freqs.weight", (base / inv).numpy().astype(np.float32))
    if kind == "longrope":  # as llama.cpp's convert_hf_to_gguf writes Phi-3's
        import math

        orig = rp["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rp["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rp["short_factor"], dtype=np.float32))


def _arch_metadata(w, gguf, cfg, arch: str, hd: int) -> None:
    if arch == "gemma3":  # the global layers' rope in the common keys, the windowed layers' base apart
        rp = cfg.rope_parameters
        _add_rope(w, gguf, cfg, rp["full_attention"], hd)
        w.add_rope_freq_base_swa(rp["sliding_attention"]["rope_theta"])
        w.add_sliding_window(cfg.sliding_window)
        windowed = [t == "sliding_attention" for t in cfg.layer_types]
        w.add_sliding_window_pattern(windowed.index(False) + 1)  # every n-th layer global
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        return
    _add_rope(w, gguf, cfg, cfg.rope_parameters, hd)
    if arch == "phi3":
        w.add_rope_dimension_count(hd)
        w.add_sliding_window(cfg.sliding_window or 0)
    elif arch == "gpt-oss":  # as llama.cpp's converter: its feed-forward length is the experts'
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)
    elif arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    elif getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)


def _tensors(name: str, a: np.ndarray, cfg, arch: str):
    """llama.cpp's (name, data) for one Hugging Face tensor, as its convert_hf_to_gguf.py writes it."""
    if name == "model.embed_tokens.weight":
        yield "token_embd.weight", a
        return
    if name == "model.norm.weight":
        yield "output_norm.weight", a + (1.0 if arch == "gemma3" else 0.0)
        return
    if name == "lm_head.weight":
        yield "output.weight", a
        return
    _, _, layer, rest = name.split(".", 3)
    if arch == "gpt-oss":
        yield from _gpt_oss_tensors(layer, rest, a)
        return
    if rest == "mlp.experts.gate_up_proj":  # [experts, 2 * intermediate, hidden]: gate rows first
        half = a.shape[1] // 2
        yield f"blk.{layer}.ffn_gate_exps.weight", a[:, :half]
        yield f"blk.{layer}.ffn_up_exps.weight", a[:, half:]
        return
    if rest == "mlp.experts.down_proj":
        yield f"blk.{layer}.ffn_down_exps.weight", a
        return
    part, kind = rest.rsplit(".", 1)
    if arch == "gemma3" and part.endswith("norm"):  # llama.cpp stores Gemma's (1 + w)
        a = a + 1.0
    if arch in PERMUTED and part == "self_attn.q_proj":
        a = permute_rows(a, cfg.num_attention_heads)
    elif arch in PERMUTED and part == "self_attn.k_proj":
        a = permute_rows(a, cfg.num_key_value_heads)
    names = dict(_LAYER, **_GEMMA_LAYER) if arch == "gemma3" else _LAYER
    yield f"blk.{layer}.{names[part]}.{kind}", a


def _gpt_oss_tensors(layer: str, rest: str, a: np.ndarray):
    """gpt-oss's tensors as llama.cpp's converter writes them from float experts: gate_up_proj
    [E, hidden, 2I] transposed and split into its even (gate) and odd (up) rows, down_proj transposed."""
    if rest == "self_attn.sinks":
        yield f"blk.{layer}.attn_sinks.weight", a
    elif rest.startswith("mlp.experts.gate_up_proj"):
        a = a if rest.endswith("_bias") else a.swapaxes(-1, -2)
        kind = "bias" if rest.endswith("_bias") else "weight"
        gate, up = (a[..., ::2], a[..., 1::2]) if kind == "bias" else (a[:, ::2], a[:, 1::2])
        yield f"blk.{layer}.ffn_gate_exps.{kind}", gate
        yield f"blk.{layer}.ffn_up_exps.{kind}", up
    elif rest == "mlp.experts.down_proj":
        yield f"blk.{layer}.ffn_down_exps.weight", a.swapaxes(-1, -2)
    elif rest == "mlp.experts.down_proj_bias":
        yield f"blk.{layer}.ffn_down_exps.bias", a
    else:
        part, kind = rest.rsplit(".", 1)
        yield f"blk.{layer}.{dict(_LAYER, **_GPT_OSS_LAYER)[part]}.{kind}", a


def gguf_matrix(name: str, a: np.ndarray, model_type: str) -> np.ndarray:
    """A Hugging Face matrix as its GGUF tensor's rows (gpt-oss's stacked experts are [in, out]:
    transposed), for rounding it along the rows the GGUF quantizes."""
    transposed = model_type == "gpt_oss" and name.endswith(("experts.gate_up_proj", "experts.down_proj"))
    return a.swapaxes(-1, -2) if transposed else a


def rounded_model(model, qtype: str, only_experts: bool = False):
    """A copy of ``model`` with every matrix (or only its experts') rounded to ``qtype`` and back by
    the gguf library, along the rows its GGUF quantizes: the reference a quantized file should match."""
    import copy

    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    t_ = GGMLQuantizationType[qtype]
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, t in out.state_dict().items():
            if t.ndim >= 2 and not name.endswith("bias") and (not only_experts or ".experts." in name):
                a = np.ascontiguousarray(gguf_matrix(name, t.float().numpy(), model.config.model_type))
                back = dequantize(quantize(a, t_), t_).reshape(a.shape)
                t.copy_(torch.from_numpy(np.ascontiguousarray(gguf_matrix(name, back, model.config.model_type))))
    return out


def gguf_model(model, path: Path):
    """A copy of ``model`` holding the weights of GGUF ``path`` (written from it, maybe quantized
    since, e.g. by llama-quantize) dequantized by the gguf library: the reference that file should
    match. Each Hugging Face tensor's entries are found in the file by sending their indices through
    the same renaming as ``write_gguf`` (for architectures whose GGUF only moves values: gpt-oss)."""
    import copy

    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    stored = {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
        tuple(int(x) for x in reversed(t.shape.tolist()))) for t in reader.tensors}
    out, cfg = copy.deepcopy(model), model.config
    with torch.no_grad():
        for name, t in out.state_dict().items():
            flat = t.view(-1)
            idx = np.arange(t.numel(), dtype=np.int64).reshape(t.shape)
            for gname, where in _tensors(name, idx, cfg, GGUF_ARCH[cfg.model_type]):
                at = torch.from_numpy(np.ascontiguousarray(where, dtype=np.int64).reshape(-1))
                flat[at] = torch.from_numpy(stored[gname].reshape(-1).copy())
    return out


def write_gguf(model, path: Path, quantize: str = "F32", experts: str | None = None) -> Path:
    """``model``'s weights as a GGUF of its llama.cpp architecture: llama.cpp's tensor and metadata
    names, and its conventions (permuted q/k rows, Gemma's stored 1 + w, stacked experts). Matrices
    are float32, or quantized by the gguf library (``quantize="Q8_0"``); norms stay float32. The
    experts' matrices in ``experts`` where given (gpt-oss's MXFP4), the others in ``quantize``."""
    import gguf

    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    add_sizes(w, cfg.max_position_embeddings, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
              cfg.num_key_value_heads, cfg.rms_norm_eps, ff=cfg.intermediate_size, head_dim=hd)
    _arch_metadata(w, gguf, cfg, arch, hd)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    for name, t in model.state_dict().items():
        for out, a in _tensors(name, t.float().numpy(), cfg, arch):
            add_tensor(w, out, a, experts if experts and "_exps." in out else quantize, keep_float=out.endswith(".bias"))
    return finish(w, path)


def add_sizes(w, context: int, hidden: int, layers: int, heads: int, kv_heads: int | list[int], rms_eps: float,
              ff: int | list[int] | None = None, head_dim: int | None = None) -> None:
    """The metadata every architecture here writes: context and embedding lengths, the block count,
    the feed-forward length (one or per layer; None: none), head counts (KV heads one count or per
    layer), key and value lengths (``head_dim``; None: none) and the norms' epsilon."""
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    if ff is not None:
        w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(rms_eps)


def add_tensor(w, name: str, a: np.ndarray, quantize: str, keep_float: bool = False) -> None:
    """One tensor into GGUF writer ``w``: float32, or a matrix (2-D or stacked) quantized by the gguf
    library to ``quantize`` ("Q8_0"; "F32": none) unless ``keep_float``."""
    import gguf
    from gguf.quants import quantize as gguf_quantize

    a = np.ascontiguousarray(a, dtype=np.float32)
    if quantize != "F32" and a.ndim >= 2 and not keep_float:
        qtype = gguf.GGMLQuantizationType[quantize]
        w.add_tensor(name, gguf_quantize(a, qtype), raw_dtype=qtype)
    else:
        w.add_tensor(name, a)


def mapped_name(names, name: str, arch: str) -> str:
    """llama.cpp's name for a Hugging Face tensor name (``.weight`` / ``.bias`` kept) in the gguf
    library's name map ``names``."""
    out = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if out is None:
        raise KeyError(f"llama.cpp has no {arch} name for {name}")
    return out


def finish(w, path: Path) -> Path:
    """Writes out GGUF writer ``w`` (header, metadata, tensors) and closes it; returns ``path``."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1] transformers' log-probability of each prompt token after the ones before it."""
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    return lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return gen[0, len(prompt):].tolist()
