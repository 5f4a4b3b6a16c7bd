"""A saved Granite 4 hybrid or Nemotron-H model as a GGUF in llama.cpp's ``granitehybrid`` /
``nemotron_h`` form (a test helper), as its converter (conversion/granite.py, nemotron.py,
mamba.py) writes one: tensor names from the gguf library's own name map; dt_bias as ssm_dt.bias,
A as -exp(A_log) and D as [heads, 1], the conv weight squeezed to [channels, K], the gated norm as
[groups, channels / groups]; Granite's fused gate/up split (ffn_* alone, ffn_*_shexp beside experts,
the experts' gate and up as ffn_gate_exps / ffn_up_exps), q/k rows permuted as for llama's rope;
KV heads and feed-forward lengths per layer, the ssm metadata and Granite's muP scales."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.arch_models import add_sizes, add_tensor, finish, permute_rows

# Tensors kept float32 whatever the output type (besides 1-D ones): the conv, the gated norm, A and D.
FLOAT_KEPT = ("ssm_conv1d", "ssm_norm", "ssm_a", "ssm_d")


def _ssm(name: str, a: np.ndarray, groups: int) -> tuple[str, np.ndarray]:
    """A Mamba2 tensor's name for the name map and its data as llama.cpp stores it."""
    if name.endswith(".dt_bias"):
        return name[:-len(".dt_bias")] + ".dt_proj.bias", a
    if name.endswith(".A_log"):
        return name, -np.exp(a).reshape(-1, 1)
    if name.endswith(".D"):
        return name, a.reshape(-1, 1)
    if name.endswith("conv1d.weight"):
        return name, a.squeeze(1)
    if name.endswith("mixer.norm.weight") or name.endswith("mamba.norm.weight"):
        return name, a.reshape(groups, -1)
    return name, a


def _granite_split(name: str, a: np.ndarray, d: dict) -> list[tuple[str, np.ndarray]]:
    """Granite's fused tensors as llama.cpp splits them, under names its map knows (none: not one)."""
    if not name.startswith("model.layers."):
        return []
    layer = name.split(".")[2]
    experts = bool(d.get("num_local_experts"))
    if name.endswith("block_sparse_moe.input_linear.weight"):  # [E, 2I, H]: gate rows first
        i = d["intermediate_size"]
        return [(f"blk.{layer}.ffn_gate_exps.weight", a[:, :i]), (f"blk.{layer}.ffn_up_exps.weight", a[:, i:])]
    if name.endswith("block_sparse_moe.output_linear.weight"):
        return [(f"blk.{layer}.ffn_down_exps.weight", a)]
    if name.endswith("shared_mlp.input_linear.weight"):
        s, tail = d["shared_intermediate_size"], "_shexp" if experts else ""
        return [(f"blk.{layer}.ffn_gate{tail}.weight", a[:s]), (f"blk.{layer}.ffn_up{tail}.weight", a[s:])]
    if name.endswith("shared_mlp.output_linear.weight") and not experts:
        return [(f"blk.{layer}.ffn_down.weight", a)]
    return []


def _metadata(w, d: dict, granite: bool) -> None:
    n = d["num_hidden_layers"]
    if granite:
        kinds = ["*" if t in ("attention", "full_attention") else "M" for t in d["layer_types"]]
        heads, head_dim, groups = d["mamba_n_heads"], d["mamba_d_head"], d["mamba_n_groups"]
        state, conv = d["mamba_d_state"], d["mamba_d_conv"]
    else:
        from ferry.model.arch.nemotron_h import pattern

        kinds = list(pattern(d))
        heads, head_dim, groups = d["mamba_num_heads"], d["mamba_head_dim"], d["n_groups"]
        state, conv = d["ssm_state_size"], d["conv_kernel"]
    # Granite: GraniteModel's feed-forward length; Nemotron-H: one per layer (0 but on MLP layers).
    ff = d["intermediate_size"] if granite else [d["intermediate_size"] if k == "-" else 0 for k in kinds]
    add_sizes(w, 2 ** 20, d["hidden_size"], n, d["num_attention_heads"],
              [d["num_key_value_heads"] if k == "*" else 0 for k in kinds],
              d.get("rms_norm_eps") or d["layer_norm_epsilon"], ff=ff, head_dim=None if granite else d["head_dim"])
    w.add_ssm_conv_kernel(conv)
    w.add_ssm_state_size(state)
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(heads * head_dim)
    w.add_ssm_time_step_rank(heads)
    w.add_bos_token_id(d["bos_token_id"])
    w.add_eos_token_id(d["eos_token_id"])
    if granite:  # GraniteModel's and GraniteMoeModel's keys, then the hybrid's
        w.add_attention_scale(d["attention_multiplier"])
        w.add_embedding_scale(d["embedding_multiplier"])
        w.add_residual_scale(d["residual_multiplier"])
        w.add_logit_scale(d["logits_scaling"])
        if d.get("num_local_experts"):
            w.add_expert_count(d["num_local_experts"])
            w.add_expert_used_count(d["num_experts_per_tok"])
            w.add_expert_feed_forward_length(d["intermediate_size"])
            w.add_expert_shared_feed_forward_length(d["shared_intermediate_size"])
        w.add_rope_freq_base(float((d.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
        w.add_rope_scaling_finetuned(False)  # a hybrid: llama.cpp rotates none of its attention


def write_gguf(model_dir: Path, path: Path, quantize: str = "F32") -> Path:
    """The checkpoint saved in ``model_dir`` as a GGUF; matrices float32, or quantized by the gguf
    library (``quantize="Q8_0"``; norms, the conv and the 1-D tensors stay float32)."""
    import gguf
    from safetensors.numpy import load_file

    d = json.loads((model_dir / "config.json").read_text())
    granite = d["model_type"] == "granitemoehybrid"
    arch = gguf.MODEL_ARCH.GRANITE_HYBRID if granite else gguf.MODEL_ARCH.NEMOTRON_H
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(w, d, granite)
    names = gguf.get_tensor_name_map(arch, d["num_hidden_layers"])
    groups = d["mamba_n_groups"] if granite else d["n_groups"]
    kv_heads, heads = d["num_key_value_heads"], d["num_attention_heads"]
    for name, a in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        a = a.astype(np.float32)
        pairs = _granite_split(name, a, d) if granite else []
        if not pairs:
            name, a = _ssm(name, a, groups)
            if name.endswith("q_proj.weight"):
                a = permute_rows(a, heads)
            elif name.endswith("k_proj.weight"):
                a = permute_rows(a, kv_heads)
            base, dot, kind = name.rpartition(".")
            out = names.get_name(base) if kind in ("weight", "bias") else names.get_name(name)
            if out is None:
                raise KeyError(f"llama.cpp has no {arch.name} name for {name}")
            pairs = [(f"{out}.{kind}" if kind in ("weight", "bias") else out, a)]
        for out, a in pairs:
            add_tensor(w, out, a, quantize, keep_float=any(k in out for k in FLOAT_KEPT))
    return finish(w, path)
