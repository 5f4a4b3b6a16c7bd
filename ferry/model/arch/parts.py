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
    "shared_gate": ("mlp.shared_expert.gate_proj", "ffn_gate_shexp"),
    "shared_up": ("mlp.shared_expert.up_proj", "ffn_up_shexp"),
    "shared_down": ("mlp.shared_expert.down_proj", "ffn_down_shexp"),
    "shared_router": ("mlp.shared_expert_gate", "ffn_gate_inp_shexp"),
    # gpt-oss's per-head sink logits: a parameter of the module itself ("self_attn.sinks", by suffix).
    "sinks": ("self_attn", "attn_sinks"),
    # Gemma 4's per-layer input block and layer scalar (a buffer of the layer itself: "layer_scalar", by suffix).
    "ple_gate": ("per_layer_input_gate", "inp_gate"), "ple_proj": ("per_layer_projection", "proj"),
    "ple_norm": ("post_per_layer_input_norm", "post_norm"), "layer_scalar": ("", "layer_output_scale"),
    # Gemma 4's per-layer input embeddings: the model's own.
    "ple_embed": ("model.embed_tokens_per_layer", "per_layer_token_embd"),
    "ple_model_proj": ("model.per_layer_model_projection", "per_layer_model_proj"),
    "ple_model_norm": ("model.per_layer_projection_norm", "per_layer_proj_norm"),
}

# The model's own tensors (the others are per layer).
MODEL_ROLES = ("embed", "final_norm", "lm_head", "ple_embed", "ple_model_proj", "ple_model_norm")

# How tensor parallelism cuts a tensor: by output rows or input columns, over the ShardPlan's span
# of query heads, KV heads, MLP columns, experts' MLP columns or vocabulary ("" : every rank holds it);
# "rows:heads": one entry per query head (the span of query heads itself, not times head_dim).
CUTS = ("", "rows:q", "rows:kv", "cols:q", "rows:mlp", "cols:mlp", "rows:experts", "cols:experts", "rows:vocab",
        "rows:heads")


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
    rotary_dim: int | None = None  # rope turns only each head's first rotary_dim values (None: all)
    # q_proj also emits a per-head gate: each head's rows are its q, then its gate (Qwen3.5); the
    # output is attention * sigmoid(gate) before o. (Tensor parallelism would need its q span doubled.)
    output_gate: bool = False
    # A learned logit per query head that joins each query's softmax denominator and holds no value
    # (gpt-oss's attention sinks): softmax over [scores, sink], the sink's share dropped.
    sinks: bool = False
    o_bias: bool = False  # a bias on the o product (gpt-oss)

    kind = "attention"
    kv_source = None  # the layer whose K/V it reads, keeping none of its own (Gemma4AttentionSpec's option)

    def cache_heads(self, c: "ModelConfig") -> tuple[int, int]:
        """(KV heads, head size) of the K/V it keeps in the paged cache."""
        return c.num_kv_heads, c.head_dim

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q_rows = 2 * q if self.output_gate else q
        out = [TensorDecl("q", (q_rows, c.hidden_size), "rows:q", "qkv"), TensorDecl("k", (kv, c.hidden_size), "rows:kv", "qkv"),
               TensorDecl("v", (kv, c.hidden_size), "rows:kv", "qkv"), TensorDecl("o", (c.hidden_size, q), "cols:q")]
        if self.bias:
            out += [TensorDecl(r, (n,), cut, "qkv_bias", suffix="bias")
                    for r, n, cut in (("q", q, "rows:q"), ("k", kv, "rows:kv"), ("v", kv, "rows:kv"))]
        if self.qk_norm:
            out += [TensorDecl("q_norm", (c.head_dim,), norm=True), TensorDecl("k_norm", (c.head_dim,), norm=True)]
        if self.sinks:
            out.append(TensorDecl("sinks", (c.num_heads,), "rows:heads", suffix="sinks"))
        if self.o_bias:  # after the o product's cut columns: every rank would add it (refused by ShardPlan)
            out.append(TensorDecl("o", (c.hidden_size,), fuse="o_bias", suffix="bias"))
        return out


@dataclass(frozen=True)
class MLPSpec:
    """act(gate) * up, then down; gate and up fused into one product."""

    act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    out_norm: bool = False
    intermediate: int | None = None  # its width (None: the model's intermediate_size; Gemma 4's double-wide layers)

    kind = "mlp"

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        i = self.intermediate or c.intermediate_size
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
    # A shared expert of this width every token runs, scaled by sigmoid(its one-row gate) (Qwen2-MoE,
    # Qwen3.5-MoE); 0: none. Not cut by tensor parallelism (every rank would add it: hybrids are refused there).
    shared_intermediate: int = 0
    # Biases on the router's logits and on each expert's gate, up and down products (gpt-oss).
    bias: bool = False
    # act "swiglu_clamp" (gpt-oss): (alpha, limit) of (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
    # g = clamp(gate, max=limit).
    swiglu: tuple[float, float] = (1.702, 7.0)

    kind = "experts"

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        e, i, h = self.num_experts, self.intermediate, c.hidden_size
        out = [TensorDecl("router", (e, h), dense=True),
               TensorDecl("expert_gate", (i, h), "rows:experts", "gate_up", experts=e),
               TensorDecl("expert_up", (i, h), "rows:experts", "gate_up", experts=e),
               TensorDecl("expert_down", (h, i), "cols:experts", experts=e)]
        if self.bias:  # each its own product key ("<...>_bias"), so none takes its weight's
            out += [TensorDecl("router", (e,), fuse="router_bias", suffix="bias", dense=True),
                    TensorDecl("expert_gate", (i,), "rows:experts", "gate_up_bias", suffix="bias", experts=e),
                    TensorDecl("expert_up", (i,), "rows:experts", "gate_up_bias", suffix="bias", experts=e),
                    TensorDecl("expert_down", (h,), fuse="down_bias", suffix="bias", experts=e)]
        if self.shared_intermediate:
            s = self.shared_intermediate
            out += [TensorDecl("shared_gate", (s, h), fuse="shared_gate_up"),
                    TensorDecl("shared_up", (s, h), fuse="shared_gate_up"), TensorDecl("shared_down", (h, s)),
                    TensorDecl("shared_router", (1, h), dense=True)]
        return out


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: x += mixer(norm(x)); x += mlp(norm(x)) (each output normed where it says).

    The mixer is attention over the paged KV cache, or a recurrent part (a spec with
    ``state_shapes``: its per-request state lives in the state slots beside the KV blocks). Either
    block may be absent (Nemotron-H's layers are one block each). Gemma 4 adds a third block,
    x += norm(proj(act(gate(x)) * the layer's per-layer input)) (``per_layer_input``: its width),
    and multiplies the layer's output by a learned scalar (``scalar``)."""

    mixer: Any
    mlp: Any = None
    per_layer_input: int = 0
    scalar: bool = False

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        norms = []
        if self.mixer is not None:
            norms += [TensorDecl("input_norm", (c.hidden_size,), norm=True)]
            norms += [TensorDecl("attn_out_norm", (c.hidden_size,), norm=True)] if self.mixer.out_norm else []
        if self.mlp is not None:
            norms += [TensorDecl("mlp_norm", (c.hidden_size,), norm=True)]
            norms += [TensorDecl("mlp_out_norm", (c.hidden_size,), norm=True)] if self.mlp.out_norm else []
        parts = [p for p in (self.mixer, self.mlp) if p is not None]
        out = norms + [t for p in parts for t in p.tensors(c)]
        if self.per_layer_input:
            p, h = self.per_layer_input, c.hidden_size
            out += [TensorDecl("ple_gate", (p, h)), TensorDecl("ple_proj", (h, p)),
                    TensorDecl("ple_norm", (h,), norm=True)]
        if self.scalar:  # a scale like a norm's: 1 in random weights
            out.append(TensorDecl("layer_scalar", (1,), norm=True, suffix="layer_scalar"))
        return out

    @property
    def attention(self) -> AttentionSpec | None:
        """Its mixer when that is attention over the KV cache."""
        return self.mixer if isinstance(self.mixer, AttentionSpec) else None

    @property
    def recurrent(self) -> Any:
        """Its mixer when that keeps a recurrent state (``state_shapes``), else None."""
        return self.mixer if hasattr(self.mixer, "state_shapes") else None


def model_tensors(hidden: int, vocab: int, tied: bool) -> list[TensorDecl]:
    """The model's own tensors: the embedding, the final norm, the LM head unless tied."""
    out = [TensorDecl("embed", (vocab, hidden), "rows:vocab"), TensorDecl("final_norm", (hidden,), norm=True)]
    return out + ([] if tied else [TensorDecl("lm_head", (vocab, hidden), "rows:vocab")])


def per_layer_tensors(c: "ModelConfig") -> list[TensorDecl]:
    """Gemma 4's per-layer input embeddings (none where ``c.per_layer_input`` is 0): a second
    embedding of every layer's input side by side, the projection of the embedding to the same, and
    the norm of each layer's share of it."""
    p, n = c.per_layer_input, c.num_layers
    if not p:
        return []
    return [TensorDecl("ple_embed", (c.per_layer_vocab or c.vocab_size, n * p)),
            TensorDecl("ple_model_proj", (n * p, c.hidden_size)), TensorDecl("ple_model_norm", (p,), norm=True)]


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


@dataclass(frozen=True)
class ShortConvSpec:
    """LFM2's gated short convolution: in_proj gives B, C and x; C * conv(B * x), a causal depthwise
    convolution over the last ``kernel`` inputs (no activation); then out_proj. Its state is the
    window of the last ``kernel - 1`` inputs of the convolution."""

    kernel: int  # config.json's conv_L_cache: the convolution's taps
    bias: bool = False  # biases on in_proj, the convolution and out_proj (conv_bias)

    kind = "short_conv"
    out_norm = False

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        h = c.hidden_size
        out = [TensorDecl("short_conv_in", (3 * h, h)), TensorDecl("short_conv", (h, 1, self.kernel)),
               TensorDecl("short_conv_out", (h, h))]
        if self.bias:
            # Each bias its own one-tensor product ("<role>_bias"), so it does not take its weight's key.
            out += [TensorDecl(r, (n,), fuse=f"{r}_bias", suffix="bias")
                    for r, n in (("short_conv_in", 3 * h), ("short_conv", h), ("short_conv_out", h))]
        return out

    def state_shapes(self, c: "ModelConfig") -> dict[str, tuple[int, ...]]:
        return {"conv": (self.kernel - 1, c.hidden_size)}


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """Qwen3.5's Gated DeltaNet (linear attention): one product gives q, k, v (through a causal
    depthwise convolution of ``conv_kernel`` taps and SiLU), the output gate z and the per-head b, a;
    q and k L2-normed; the gated delta rule with decay g = -exp(A_log) * softplus(a + dt_bias) and
    rate beta = sigmoid(b) (each q/k head serves ``v_heads // k_heads`` value heads); a
    plain-w RMS norm of each value head times silu(z); then out_proj. Its state is the convolution's
    window and each value head's [k_dim, v_dim] matrix (transformers' orientation: out = q @ S)."""

    k_heads: int  # linear_num_key_heads
    v_heads: int  # linear_num_value_heads
    k_dim: int  # linear_key_head_dim
    v_dim: int  # linear_value_head_dim
    conv_kernel: int = 4  # linear_conv_kernel_dim
    # llama.cpp's order of the value heads (its GGUFs): value head h reads q/k head h % k_heads,
    # not h // (v_heads // k_heads); the state is per value head either way.
    v_tiled: bool = False

    kind = "gated_deltanet"
    out_norm = False

    @property
    def conv_dim(self) -> int:
        """The convolved channels: q, k, v side by side."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        h, hv, vd = c.hidden_size, self.v_heads, self.v_heads * self.v_dim
        return [TensorDecl("gdn_qkv", (self.conv_dim, h), fuse="gdn_in"), TensorDecl("gdn_z", (vd, h), fuse="gdn_in"),
                TensorDecl("gdn_b", (hv, h), fuse="gdn_in"), TensorDecl("gdn_a", (hv, h), fuse="gdn_in"),
                TensorDecl("gdn_conv", (self.conv_dim, 1, self.conv_kernel)),
                TensorDecl("gdn_A_log", (hv,), suffix="A_log"), TensorDecl("gdn_dt_bias", (hv,), suffix="dt_bias"),
                TensorDecl("gdn_norm", (self.v_dim,)), TensorDecl("gdn_out", (h, vd))]

    def state_shapes(self, c: "ModelConfig") -> dict[str, tuple[int, ...]]:
        return {"conv": (self.conv_kernel - 1, self.conv_dim), "ssm": (self.v_heads, self.k_dim, self.v_dim)}


def mamba2_names(module: str) -> dict[str, tuple[str, str]]:
    """A Mamba2 mixer's roles under ``module`` of a layer (Granite 4: "mamba", Nemotron-H: "mixer"),
    with llama.cpp's names. A_log, D and dt_bias carry no ".weight": their declarations name them by
    suffix; each bias is its own role (its own one-tensor product, "<role>_bias")."""
    return {"ssm_in": (f"{module}.in_proj", "ssm_in"), "ssm_conv1d": (f"{module}.conv1d", "ssm_conv1d"),
            "ssm_dt": (module, "ssm_dt"), "ssm_a": (module, "ssm_a"), "ssm_d": (module, "ssm_d"),
            "ssm_norm": (f"{module}.norm", "ssm_norm"), "ssm_out": (f"{module}.out_proj", "ssm_out")}


@dataclass(frozen=True)
class Mamba2Spec:
    """Mamba2's selective state-space mixer (SSD): in_proj gives the gate z, the convolved xBC and
    one time step per head; a causal depthwise convolution of ``conv_kernel`` taps with SiLU on xBC,
    split into x (``heads`` heads of ``head_dim``), B and C (``n_groups`` groups of ``d_state``, each
    shared by heads / n_groups consecutive heads); dt = softplus(dt + dt_bias) within ``dt_limit``;
    the scan with A = -exp(A_log) and the D skip, chunked by ``chunk_size`` over a prefill; an RMS
    norm of y * silu(z) over each of the n_groups groups of channels (plain w); out_proj. Its state is
    the convolution's window and each head's [head_dim, d_state] matrix."""

    heads: int
    head_dim: int
    d_state: int
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 256
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    conv_bias: bool = True
    proj_bias: bool = False  # biases on in_proj and out_proj

    kind = "mamba2"
    out_norm = False

    @property
    def inner(self) -> int:
        """The scanned channels: heads * head_dim."""
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: x, B and C side by side."""
        return self.inner + 2 * self.n_groups * self.d_state

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        h, inner, conv, heads = c.hidden_size, self.inner, self.conv_dim, self.heads
        out = [TensorDecl("ssm_in", (inner + conv + heads, h)), TensorDecl("ssm_conv1d", (conv, 1, self.conv_kernel)),
               TensorDecl("ssm_dt", (heads,), suffix="dt_bias"), TensorDecl("ssm_a", (heads,), suffix="A_log"),
               TensorDecl("ssm_d", (heads,), suffix="D"), TensorDecl("ssm_norm", (inner,)),
               TensorDecl("ssm_out", (h, inner))]
        biases = [("ssm_conv1d", conv)] if self.conv_bias else []
        biases += [("ssm_in", inner + conv + heads), ("ssm_out", h)] if self.proj_bias else []
        return out + [TensorDecl(r, (n,), fuse=f"{r}_bias", suffix="bias") for r, n in biases]

    def state_shapes(self, c: "ModelConfig") -> dict[str, tuple[int, ...]]:
        return {"conv": (self.conv_kernel - 1, self.conv_dim), "ssm": (self.heads, self.head_dim, self.d_state)}


@dataclass(frozen=True)
class NoRopeAttentionSpec(AttentionSpec):
    """Softmax attention over the paged KV cache with q and k not rotated: the recurrent layers carry
    the order (Granite 4's hybrids, position_embedding_type "nope"; Nemotron-H)."""

    kind = "attention_nope"


@dataclass(frozen=True)
class PlainMLPSpec:
    """act(up), then down: a non-gated MLP (Nemotron-H's relu^2) of ``intermediate`` columns (None:
    the model's intermediate_size)."""

    act: str = "relu2"
    intermediate: int | None = None
    out_norm: bool = False

    kind = "plain_mlp"

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        i = self.intermediate or c.intermediate_size
        return [TensorDecl("up", (i, c.hidden_size), "rows:mlp"), TensorDecl("down", (c.hidden_size, i), "cols:mlp")]


@dataclass(frozen=True)
class StackedExpertsSpec(ExpertsSpec):
    """Granite 4's experts: the router's softmax over each token's top-k logits (renorm), every
    expert of a projection in one 3-D checkpoint tensor ([experts, 2 * intermediate, hidden], each
    expert's gate rows first; [experts, hidden, intermediate]; one tensor per expert where not
    ``stacked``, as a GGUF gives them), and a shared gated MLP of the model's intermediate_size on
    the same input, added (no gate on it)."""

    stacked: bool = True

    kind = "stacked_experts"

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        e, i, h = self.num_experts, self.intermediate, c.hidden_size
        routed = ([TensorDecl("router", (e, h), dense=True), TensorDecl("experts_gate_up", (e, 2 * i, h)),
                   TensorDecl("experts_down", (e, h, i))] if self.stacked else ExpertsSpec.tensors(self, c))
        return routed + MLPSpec(self.act).tensors(c)


@dataclass(frozen=True)
class SigmoidExpertsSpec(ExpertsSpec):
    """Nemotron-H's (Nemotron 3) experts: sigmoid scores plus a correction bias choose the top-k
    among the best ``topk_groups`` of ``groups`` groups (a group's score: its two best); the chosen
    experts' sigmoid scores (renormalised where ``renorm``) times ``scale`` weigh non-gated act(up)
    -> down experts, run in a ``latent`` space where given (fc1/fc2 around them); a shared non-gated
    MLP of ``shared`` columns on the input is added."""

    shared: int = 0
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0
    latent: int | None = None

    kind = "sigmoid_experts"

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        e, i, h = self.num_experts, self.intermediate, c.hidden_size
        x = self.latent or h
        out = [TensorDecl("router", (e, h), dense=True),
               TensorDecl("router_bias", (e,), dense=True, suffix="e_score_correction_bias"),
               TensorDecl("expert_up", (i, x), experts=e), TensorDecl("expert_down", (x, i), experts=e),
               TensorDecl("shared_up", (self.shared, h)), TensorDecl("shared_down", (h, self.shared))]
        if self.latent:
            out += [TensorDecl("latent_in", (x, h)), TensorDecl("latent_out", (h, x))]
        return out


@dataclass(frozen=True)
class Gemma4AttentionSpec(AttentionSpec):
    """Gemma 4's attention: q/k norms, a scale-less RMS norm of each head of v, its own head size and
    KV heads (the global layers'), and, in the last layers, no K/V of its own: it reads those that
    layer ``kv_source`` (an earlier layer of the same kind) wrote in the cache this step. Its rope
    table is ``rotary_dim`` (its head size) wide: the partial rotation is in the table ("proportional").
    With ``k_eq_v`` v is k's projection (no v_proj)."""

    head_dim: int | None = None  # None: the model's
    kv_heads: int | None = None  # None: the model's
    kv_source: int | None = None
    k_eq_v: bool = False

    kind = "gemma4_attention"

    def cache_heads(self, c: "ModelConfig") -> tuple[int, int]:
        return self.kv_heads or c.num_kv_heads, self.head_dim or c.head_dim

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        hkv, hd = self.cache_heads(c)
        q, kv, h = c.num_heads * hd, hkv * hd, c.hidden_size
        out = [TensorDecl("q", (q, h), "rows:q", "qkv")]
        if self.kv_source is None:
            out.append(TensorDecl("k", (kv, h), "rows:kv", "qkv"))
            out += [] if self.k_eq_v else [TensorDecl("v", (kv, h), "rows:kv", "qkv")]
        out += [TensorDecl("o", (h, q), "cols:q"), TensorDecl("q_norm", (hd,), norm=True)]
        return out + ([TensorDecl("k_norm", (hd,), norm=True)] if self.kv_source is None else [])


@dataclass(frozen=True)
class Gemma4MoESpec(MLPSpec):
    """Gemma 4's feed-forward block with routed experts (26B-A4B, enable_moe_block): of the block's
    input x, the dense GeGLU of mlp_norm(x) normed by post_feedforward_layernorm_1, plus routed
    experts of pre_feedforward_layernorm_2(x) normed by post_feedforward_layernorm_2; the sum is
    the block's output (its out_norm, post_feedforward_layernorm, is the residual's). The router
    reads x normed with no weight, times its own scale and hidden ** -0.5, takes the softmax's top k
    renormalised, and weighs each chosen expert by its per_expert_scale."""

    num_experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0

    kind = "gemma4_moe"
    reads_residual = True  # its norms are its own: the residual block hands it x unnormed

    def tensors(self, c: "ModelConfig") -> list[TensorDecl]:
        e, i, h = self.num_experts, self.expert_intermediate, c.hidden_size
        return MLPSpec.tensors(self, c) + [
            TensorDecl("mlp_out_norm_1", (h,), norm=True), TensorDecl("moe_norm", (h,), norm=True),
            TensorDecl("moe_out_norm", (h,), norm=True), TensorDecl("router", (e, h), dense=True),
            TensorDecl("router_scale", (h,), dense=True, suffix="scale"),
            TensorDecl("expert_scale", (e,), dense=True, suffix="per_expert_scale"),
            TensorDecl("expert_gate", (i, h), "rows:experts", "gate_up", experts=e),
            TensorDecl("expert_up", (i, h), "rows:experts", "gate_up", experts=e),
            TensorDecl("expert_down", (h, i), "cols:experts", experts=e)]
