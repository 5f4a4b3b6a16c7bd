"""What a decoder layer is made of, and the tensors each part holds, as plain data.

An architecture declares its layers as a tuple of ``LayerSpec`` (a mixer and an MLP, each with its
options); each part's ``tensors`` lists its weights by role. A role's names (Hugging Face and
llama.cpp's GGUF) come from ``NAMES`` unless the architecture renames it. The loader (safetensors,
GGUF, ``load_format="dummy"``), tensor-parallel slicing and the decoder's fusions read only these
declarations. Pure Python: the simulator reads configs without torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ferry.model.config import ModelConfig

# role -> (Hugging Face name, GGUF name), relative to a layer ("model.layers.{i}." / "blk.{i}.") or,
# for the model's own tensors, whole. "{e}": one tensor per expert (GGUF: one 3-D tensor of all).
NAMES: dict[str, tuple[str, str]] = {
    "embed": ("model.embed_tokens", "token_embd"), "final_norm": ("model.norm", "output_norm"),
    "lm_head": ("lm_head", "output"),
    "input_norm": ("input_layernorm", "attn_norm"), "mlp_norm": ("post_attention_layernorm", "ffn_norm"),
    "q": ("self_attn.q_proj", "attn_q"), "k": ("self_attn.k_proj", "attn_k"), "v": ("self_attn.v_proj", "attn_v"),
    "o": ("self_attn.o_proj", "attn_output"),
    "q_norm": ("self_attn.q_norm", "attn_q_norm"), "k_norm": ("self_attn.k_norm", "attn_k_norm"),
    "attn_out_norm": ("post_attention_layernorm", "post_attention_norm"),
    "mlp_out_norm": ("post_feedforward_layernorm", "post_ffw_norm"),
    "gate": ("mlp.gate_proj", "ffn_gate"), "up": ("mlp.up_proj", "ffn_up"), "down": ("mlp.down_proj", "ffn_down"),
    "router": ("mlp.gate", "ffn_gate_inp"),
    "expert_gate": ("mlp.experts.{e}.gate_proj", "ffn_gate_exps"),
    "expert_up": ("mlp.experts.{e}.up_proj", "ffn_up_exps"),
    "expert_down": ("mlp.experts.{e}.down_proj", "ffn_down_exps"),
}

# How tensor parallelism cuts a tensor: by output rows or input columns, over the ShardPlan's span
# of query heads, KV heads, MLP columns, experts' MLP columns or vocabulary ("" : every rank holds it).
CUTS = ("", "rows:q", "rows:kv", "cols:q", "rows:mlp", "cols:mlp", "rows:experts", "cols:experts", "rows:vocab")


@dataclass(frozen=True)
class TensorDecl:
    """One weight: its role (a key of NAMES), suffix ("weight" or "bias"), shape, cut, and the fused
    product it joins (its rows stacked with the others' in declaration order)."""

    role: str
    shape: tuple[int, ...]
    cut: str = ""
    fuse: str | None = None  # "qkv", "gate_up": one product of several checkpoint tensors
    norm: bool = False  # an RMS norm's scale: the architecture's norm offset applies (Gemma's 1 + w)
    suffix: str = "weight"
    dense: bool = False  # kept float even from a quantized file (a router's few rows)
    experts: int = 0  # one tensor per expert ("{e}" in its names)


@dataclass(frozen=True)
class AttentionSpec:
    """Softmax attention over the paged KV cache, with q/k/v fused into one product."""

    window: int | None = None  # attends this many tokens back (None: every earlier token)
    rope: tuple[float, dict[str, Any] | None] = (10000.0, None)  # (theta, scaling) of its rotation
    qk_norm: bool = False  # an RMS norm on each head's q and k before rope (Qwen3, Gemma)
    bias: bool = False  # biases on q, k, v (Qwen2)
    scale: float | None = None  # softmax scale (None: head_dim ** -0.5)
    out_norm: bool = False  # an RMS norm of its output before the residual add (Gemma)

    kind = "attention"

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        out = [TensorDecl("q", (q, c.hidden_size), "rows:q", "qkv"), TensorDecl("k", (kv, c.hidden_size), "rows:kv", "qkv"),
               TensorDecl("v", (kv, c.hidden_size), "rows:kv", "qkv"), TensorDecl("o", (c.hidden_size, q), "cols:q")]
        if self.bias:
            out += [TensorDecl(r, (n,), cut, "qkv_bias", suffix="bias")
                    for r, n, cut in (("q", q, "rows:q"), ("k", kv, "rows:kv"), ("v", kv, "rows:kv"))]
        if self.qk_norm:
            out += [TensorDecl("q_norm", (c.head_dim,), norm=True), TensorDecl("k_norm", (c.head_dim,), norm=True)]
        return out


@dataclass(frozen=True)
class MLPSpec:
    """act(gate) * up, then down; gate and up fused into one product."""

    act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    out_norm: bool = False

    kind = "mlp"

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        i = c.intermediate_size
        return [TensorDecl("gate", (i, c.hidden_size), "rows:mlp", "gate_up"),
                TensorDecl("up", (i, c.hidden_size), "rows:mlp", "gate_up"), TensorDecl("down", (c.hidden_size, i), "cols:mlp")]


@dataclass(frozen=True)
class ExpertsSpec:
    """Routed experts: a router picks each token's top k of ``num_experts`` gated MLPs."""

    num_experts: int
    top_k: int
    intermediate: int
    renorm: bool = False  # the chosen experts' weights renormalised to sum to 1
    act: str = "silu"
    out_norm: bool = False

    kind = "experts"

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        e, i = self.num_experts, self.intermediate
        return [TensorDecl("router", (e, c.hidden_size), dense=True),
                TensorDecl("expert_gate", (i, c.hidden_size), "rows:experts", "gate_up", experts=e),
                TensorDecl("expert_up", (i, c.hidden_size), "rows:experts", "gate_up", experts=e),
                TensorDecl("expert_down", (c.hidden_size, i), "cols:experts", experts=e)]


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: x += mixer(norm(x)); x += mlp(norm(x)) (each output normed where it says)."""

    mixer: AttentionSpec
    mlp: MLPSpec | ExpertsSpec

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        norms = [TensorDecl("input_norm", (c.hidden_size,), norm=True)]
        norms += [TensorDecl("attn_out_norm", (c.hidden_size,), norm=True)] if self.mixer.out_norm else []
        norms += [TensorDecl("mlp_norm", (c.hidden_size,), norm=True)]
        norms += [TensorDecl("mlp_out_norm", (c.hidden_size,), norm=True)] if self.mlp.out_norm else []
        return norms + self.mixer.tensors(c) + self.mlp.tensors(c)


def model_tensors(hidden: int, vocab: int, tied: bool) -> list[TensorDecl]:
    """The model's own tensors: the embedding, the final norm, the LM head unless tied."""
    out = [TensorDecl("embed", (vocab, hidden), "rows:vocab"), TensorDecl("final_norm", (hidden,), norm=True)]
    return out + ([] if tied else [TensorDecl("lm_head", (vocab, hidden), "rows:vocab")])


def hidden_act(d: dict[str, Any], where: str = "config.json") -> str:
    """The MLP's activation named by config.json, as ferry's parts call it."""
    act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    act = {"gelu_pytorch_tanh": "gelu_tanh"}.get(act, act)
    if act not in ("silu", "gelu_tanh"):
        raise ValueError(f"unsupported hidden_act {act!r} in {where}; ferry runs 'silu' and 'gelu_pytorch_tanh'")
    return act


def llama_layers(d: dict[str, Any], *, windows: list[int | None] | None = None,
                 ropes: list[tuple[float, dict[str, Any] | None]] | None = None, experts: list[bool] | None = None,
                 expert_spec: Callable[[], ExpertsSpec] | None = None, **attention: Any) -> tuple[LayerSpec, ...]:
    """The Llama-shaped layers of config.json ``d``: every layer's attention with the given options
    (per layer windows and ropes where given), a gated MLP or, where ``experts`` says, routed experts."""
    from ferry.model.config import rope_scaling

    n = d["num_hidden_layers"]
    act = hidden_act(d)
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    default_rope = (float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0), rope_scaling(rope, "config.json"))
    out = []
    for i in range(n):
        mixer = AttentionSpec(window=windows[i] if windows else None, rope=ropes[i] if ropes else default_rope,
                              **attention)
        out_norm = attention.get("out_norm", False)
        mlp = expert_spec() if experts and experts[i] else MLPSpec(act, out_norm)
        out.append(LayerSpec(mixer, mlp))
    return tuple(out)
