"""gpt-oss: attention with sinks, q/k/v and o biases, sliding-window and full layers alternating (as
``layer_types`` says), rope as its config says (YaRN); on every layer a router with a bias picks the
top k experts (softmax of their logits), each expert a gated MLP with biases and gpt-oss's clamped
SwiGLU, (clamp(up) + 1) * g * sigmoid(alpha * g).

The checkpoint stacks each layer's experts: ``mlp.experts.gate_up_proj`` [E, hidden, 2I] (gate and up
columns interleaved) and ``down_proj`` [E, I, hidden], with ``*_bias`` beside them; ``split_experts``
gives them the per-expert names the declarations read. The published checkpoints store the experts in
MXFP4 instead: ``gate_up_proj_blocks`` [E, 2I, hidden / 32, 16] (uint8, two E2M1 codes a byte, the low
nibble first) and ``gate_up_proj_scales`` [E, 2I, hidden / 32] (E8M0), ``down_proj_*`` likewise, rows
being output features; they are kept in those blocks (GGML's MXFP4 layout, the same codes and scales)
where the C kernels run, else dequantized. llama.cpp's GGUF (``gpt-oss``) stores them split already,
its experts in MXFP4 where the source was."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ferry.model.arch import Architecture
from ferry.model.arch.parts import ExpertsSpec, llama_layers

if TYPE_CHECKING:  # the registry imports this module where torch is not loaded (ferry simulate)
    import torch


def configure(d: dict[str, Any]) -> dict[str, Any]:
    n = d["num_hidden_layers"]
    kinds = d.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    spec = ExpertsSpec(d["num_local_experts"], d["num_experts_per_tok"], d["intermediate_size"], renorm=True,
                       act="swiglu_clamp", bias=True,
                       swiglu=(float(d.get("swiglu_alpha", 1.702)), float(d.get("swiglu_limit", 7.0))))
    window = d.get("sliding_window")
    return {"layers": llama_layers(d, bias=bool(d.get("attention_bias", True)), o_bias=bool(d.get("attention_bias", True)),
                                   sinks=True, windows=[window if k == "sliding_attention" else None for k in kinds],
                                   experts=[True] * n, expert_spec=lambda: spec)}


# E2M1's values (transformers' FP4_VALUES): a sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The checkpoint's MXFP4 ``blocks`` [..., n / 32, 16] and ``scales`` [..., n / 32] as GGML MXFP4
    rows [..., n / 32 * 17]: per block its scale byte, then 16 bytes whose low nibbles are the
    block's first 16 codes and high nibbles its last 16 (the checkpoint pairs codes 2j, 2j + 1)."""
    import torch

    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # [..., n / 32, 32] in order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1).flatten(-2).contiguous()


def mxfp4_float(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., n] of the checkpoint's MXFP4 blocks (transformers' convert_moe_packed_tensors)."""
    import torch

    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).long()
    values = torch.tensor(E2M1)[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2)


def _mxfp4_experts(weights: dict[str, Any], base: str) -> None:
    """A layer's MXFP4 experts as one weight per expert and projection (see ``split_experts``)."""
    from ferry.model.kernels import load_kernels
    from ferry.model.quant import QuantWeight

    kept = load_kernels() is not None
    for proj in ("gate_up_proj", "down_proj"):
        blocks, scales = weights.pop(f"{base}{proj}_blocks"), weights.pop(f"{base}{proj}_scales")
        k = blocks.shape[-2] * 32
        rows = mxfp4_rows(blocks, scales) if kept else mxfp4_float(blocks, scales)
        bias = weights.pop(f"{base}{proj}_bias")
        for e in range(rows.shape[0]):
            parts = {"gate_proj": (rows[e, 0::2], bias[e, 0::2]), "up_proj": (rows[e, 1::2], bias[e, 1::2])} \
                if proj == "gate_up_proj" else {"down_proj": (rows[e], bias[e])}
            for name, (w, b) in parts.items():
                w = w.contiguous()
                weights[f"{base}{e}.{name}.weight"] = QuantWeight(w, "MXFP4", (w.shape[0], k)) if kept else w
                weights[f"{base}{e}.{name}.bias"] = b.contiguous()


def split_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """Each layer's stacked expert tensors as one tensor per expert and projection: gate and up the
    even and odd columns of gate_up_proj (rows of its MXFP4 blocks), each matrix transposed to [out, in]."""
    for name in [n for n in weights if n.endswith(".mlp.experts.gate_up_proj_blocks")]:
        _mxfp4_experts(weights, name[: -len("gate_up_proj_blocks")])
    for name in [n for n in weights if n.endswith(".mlp.experts.gate_up_proj")]:
        base = name[: -len("gate_up_proj")]
        gate_up, down = weights.pop(name), weights.pop(base + "down_proj")
        gu_bias, down_bias = weights.pop(base + "gate_up_proj_bias"), weights.pop(base + "down_proj_bias")
        for e in range(gate_up.shape[0]):
            w = gate_up[e].t()  # [2I, hidden], gate and up rows interleaved
            weights[f"{base}{e}.gate_proj.weight"] = w[0::2].contiguous()
            weights[f"{base}{e}.up_proj.weight"] = w[1::2].contiguous()
            weights[f"{base}{e}.gate_proj.bias"] = gu_bias[e, 0::2].contiguous()
            weights[f"{base}{e}.up_proj.bias"] = gu_bias[e, 1::2].contiguous()
            weights[f"{base}{e}.down_proj.weight"] = down[e].t().contiguous()
            weights[f"{base}{e}.down_proj.bias"] = down_bias[e].contiguous()
    return weights


def gguf_configure(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json from llama.cpp's gpt-oss metadata: every other layer windowed (the first one
    so, as llama.cpp's pattern of 2), the experts' sizes, and YaRN untruncated as gpt-oss's config says."""
    from ferry.model.gguf_convert import _rope_scaling

    n, window = meta("block_count"), meta("attention.sliding_window")
    out = {"num_local_experts": meta("expert_count"), "num_experts_per_tok": meta("expert_used_count"),
           "intermediate_size": meta("expert_feed_forward_length") or meta("feed_forward_length"),
           "sliding_window": window, "attention_bias": True,
           "layer_types": ["sliding_attention" if window and i % 2 == 0 else "full_attention" for i in range(n)]}
    rope = _rope_scaling(meta, tensors)
    if rope and rope["rope_type"] == "yarn":
        out["rope_scaling"] = dict(rope, truncate=False)
    return out


ARCH = Architecture("GptOssForCausalLM", "gpt_oss", gguf_name="gpt-oss", configure=configure,
                    gguf_configure=gguf_configure, checkpoint_tensors=split_experts,
                    names={"router": ("mlp.router", "ffn_gate_inp"),
                           "mlp_norm": ("post_attention_layernorm", "post_attention_norm")})
