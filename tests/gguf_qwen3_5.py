"""A transformers Qwen3.5 (or -MoE) model's weights as a GGUF in llama.cpp's ``qwen35`` /
``qwen35moe`` form (a test helper), as its converter (conversion/qwen.py, ``--no-mtp``) writes one:
value heads reordered from grouped to tiled order where they outnumber the key heads, A_log stored
as -exp(A_log), dt_bias as ssm_dt.bias, the conv weight squeezed, (1 + w) norms stored as 1 + w (not
the gated norm), experts stacked, tensor names from the gguf library's own name map; metadata as
its Qwen3NextModel writes it (ssm.*, recurrent layers, the rotated dimensions)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.arch_models import add_sizes, add_tensor, finish, mapped_name

# Tensors llama.cpp's converter keeps float32 whatever the output type (besides 1-D ones and norms).
FLOAT_KEPT = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def tiled(a: np.ndarray, axis: int, k_heads: int, per_k: int, head_dim: int) -> np.ndarray:
    """llama.cpp's _reorder_v_heads: value heads grouped by key head -> tiled over the key heads."""
    shape = a.shape
    a = a.reshape(*shape[:axis], k_heads, per_k, head_dim, *shape[axis + 1:])
    return np.swapaxes(a, axis, axis + 1).reshape(shape)


def _reorder(name: str, a: np.ndarray, cfg) -> np.ndarray:
    k, v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if k == v or "linear_attn." not in name:
        return a
    r, kd, vd = v // k, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if ".in_proj_qkv." in name or ".conv1d." in name:  # the value rows (channels) only
        a = a.squeeze() if ".conv1d." in name else a
        return np.concatenate([a[:2 * k * kd], tiled(a[2 * k * kd:], 0, k, r, vd)])
    if ".in_proj_z." in name:
        return tiled(a, 0, k, r, vd)
    if ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
        return tiled(a, 0, k, r, 1)
    if ".out_proj." in name:
        return tiled(a, 1, k, r, vd)
    return a


def _converted(name: str, a: np.ndarray, cfg):
    """(Hugging Face-ish name the name map knows, array) pairs, as Qwen3NextModel and Qwen2MoeModel
    hand them on."""
    a = _reorder(name, a, cfg)
    if name.endswith(".A_log"):
        a = -np.exp(a)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        a = a.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        a = a + 1.0
    if name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * intermediate, hidden]: gate rows first
        half = a.shape[1] // 2
        base = name.removesuffix(".gate_up_proj")
        return [(f"{base}.gate_proj.weight", a[:, :half]), (f"{base}.up_proj.weight", a[:, half:])]
    if name.endswith("mlp.experts.down_proj"):
        return [(f"{name}.weight", a)]
    return [(name, a)]


def write_gguf(model, path: Path, quantize: str = "F32") -> Path:
    """``model``'s weights as a qwen35 (qwen35moe) GGUF; matrices float32, or quantized by the gguf
    library (``quantize="Q8_0"``) as llama.cpp's converter quantizes them."""
    import gguf

    cfg = model.config
    moe = cfg.model_type == "qwen3_5_moe_text"
    arch = gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    rope = cfg.rope_parameters
    add_sizes(w, cfg.max_position_embeddings, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
              cfg.num_key_value_heads, cfg.rms_norm_eps, head_dim=cfg.head_dim,
              ff=None if moe else cfg.intermediate_size)  # transformers' Qwen3.5-MoE config has no intermediate_size
    w.add_rope_freq_base(rope["rope_theta"])
    if moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    # (this gguf library has no add_recurrent_layers: the key as llama.cpp's writer names it)
    w.add_array(f"{gguf.MODEL_ARCH_NAMES[arch]}.attention.recurrent_layers",
                [t == "linear_attention" for t in cfg.layer_types])
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for hf, t in model.state_dict().items():
        for name, a in _converted(hf, t.float().numpy(), cfg):
            out = mapped_name(names, name, gguf.MODEL_ARCH_NAMES[arch])
            add_tensor(w, out, a, quantize, keep_float=out.endswith(FLOAT_KEPT))
    return finish(w, path)
