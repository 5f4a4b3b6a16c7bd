"""GGUF weights kept quantized: the kernel's products equal dequantize-then-matmul, the repacked
weights dequantize bit for bit as the gguf library does, and unsupported types are refused."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from ferry.model.kernels import load_kernels
from ferry.model.quant import ACTIVATION_MODES, E8M0_TYPES, KERNEL_ROWS, Q8_ISAS, QUANT_TYPES, QuantWeight, RowStack, \
    cat_rows, check_kernel_types, dequantize, load_gguf_weights, packed, q8_isa, quant_linear, repack

# Where each type's float16 scales sit in its block (the type table's d and min): random bytes
# elsewhere are valid quants and sub-scales, random bytes here could be NaN.
F16_FIELDS = {name: t.float16_fields for name, t in QUANT_TYPES.items()}
# Every scale's bytes: the float16 ones, or an E8M0 byte (MXFP4).
SCALE_FIELDS = {name: (t.d_at, t.d_at + 1) if name in E8M0_TYPES else F16_FIELDS[name] for name, t in QUANT_TYPES.items()}
# Shapes (N, K) per type: K whole blocks, N not a multiple of the kernels' register blocks.
SHAPES = {t: [(1, 32), (5, 96), (37, 576)] if q.block == 32 else [(1, 256), (37, 768)] for t, q in QUANT_TYPES.items()}
CASES = [(t, n, k) for t in sorted(SHAPES) for n, k in SHAPES[t]]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if load_kernels() is None:
        pytest.fail("the kernels could not be built (no C compiler?)")


def random_gguf_rows(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """n rows of k weights as a GGUF file stores them: random quants, float16 scales of either sign."""
    rng = np.random.default_rng(seed)
    t = QUANT_TYPES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // t.block, t.nbytes), dtype=np.uint8)
    a, b = F16_FIELDS[qtype]
    blocks[..., a:b] = rng.normal(0, 0.02, size=(n, k // t.block, (b - a) // 2)).astype(np.float16).view(np.uint8)
    if qtype in E8M0_TYPES:  # powers of two 2^-10 .. 2^-3, as the float16 scales' magnitudes
        blocks[..., t.d_at] = rng.integers(118, 126, size=(n, k // t.block), dtype=np.uint8)
    return blocks.reshape(n, -1)


def gguf_type(qtype: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[qtype]


def test_the_type_table_is_gguf_s_and_the_kernels_own(monkeypatch):
    from gguf import GGML_QUANT_SIZES

    for name, t in QUANT_TYPES.items():
        assert (t.kernel_id, (t.block, t.nbytes)) == (gguf_type(name).value, GGML_QUANT_SIZES[gguf_type(name)])
    check_kernel_types(load_kernels())
    monkeypatch.setitem(QUANT_TYPES, "Q6_K", replace(QUANT_TYPES["Q6_K"], nbytes=208))
    with pytest.raises(RuntimeError, match="quant_types.h"):
        check_kernel_types(load_kernels())


@pytest.mark.parametrize("field,value", [("group", 32), ("offset", True), ("shift", 0), ("d_at", 206)])
def test_every_trait_of_the_type_table_is_checked_against_the_kernels(monkeypatch, field, value):
    """The facts the kernels read per type (scale group, offset, level shift, where d sits) are one
    row of kernels/quant_types.h: a Python row that differs in any of them is refused, naming it."""
    monkeypatch.setitem(QUANT_TYPES, "Q6_K", replace(QUANT_TYPES["Q6_K"], **{field: value}))
    with pytest.raises(RuntimeError, match=r"quant_types.h differs .*'Q6_K'"):
        check_kernel_types(load_kernels())


@pytest.mark.parametrize("qtype,n,k", CASES + [("Q4_1", 131, 64), ("Q6_K", 70, 1536)])
def test_weights_dequantize_as_gguf_does(qtype, n, k):
    raw = random_gguf_rows(qtype, n, k, seed=n + k)
    w = repack(raw, qtype, (n, k))
    assert w.nbytes == raw.nbytes  # the file's blocks, as they are
    expected = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, gguf_type(qtype)).reshape(n, k)))
    assert torch.equal(dequantize(w), expected)
    rows = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(dequantize(w, rows), expected[rows])


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 31, 32, 33, 100])
@pytest.mark.parametrize("qtype,n,k", CASES)
def test_products_equal_dequantize_then_matmul(qtype, m, n, k):
    """Both paths (the kernel for few rows, dequantize-then-BLAS), ragged M and N (not multiples
    of the register blocks) and K of 1 to 18 blocks."""
    w = repack(random_gguf_rows(qtype, n, k, seed=m * n + k), qtype, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = quant_linear(x, w)
    assert y.shape == (m, n) and y.is_contiguous()
    ref = x @ dequantize(w).t()
    # Sums of up to 768 terms in another order: float32 rounding relative to the outputs' size.
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))


def test_fused_rows_stack_like_their_parts():
    a = repack(random_gguf_rows("Q4_1", 40, 64, 1), "Q4_1", (40, 64))
    b = repack(random_gguf_rows("Q4_1", 8, 64, 2), "Q4_1", (8, 64))
    c = repack(random_gguf_rows("Q8_0", 8, 64, 3), "Q8_0", (8, 64))
    both = cat_rows([a, b])
    assert isinstance(both, QuantWeight) and both.shape == (48, 64)
    assert torch.equal(dequantize(both), torch.cat([dequantize(a), dequantize(b)]))
    mixed = cat_rows([a, b, c])  # different types: a stack of runs, each kept in its blocks
    assert isinstance(mixed, RowStack) and [p.qtype for p in mixed.parts] == ["Q4_1", "Q8_0"]
    assert mixed.shape == (56, 64) and mixed.nbytes == a.nbytes + b.nbytes + c.nbytes
    assert torch.equal(dequantize(mixed), torch.cat([dequantize(a), dequantize(b), dequantize(c)]))
    x = torch.randn(3, 64)
    for mode in ACTIVATION_MODES:
        for w in (a, b, c):
            w.activations = mode
        stack = cat_rows([a, b, c])
        parts = torch.cat([quant_linear(x, a), quant_linear(x, b), quant_linear(x, c)], dim=1)
        assert torch.equal(quant_linear(x, stack), parts)
    floats = cat_rows([a, torch.zeros(8, 64)])  # a float part: float32
    assert isinstance(floats, torch.Tensor) and torch.equal(floats[:40], dequantize(a))


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(len(tensors))
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    for name, (raw, qtype) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=gguf_type(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_file_with_every_type_loads_quantized(tmp_path):
    """The gguf library quantizes what it can (Q4_0 ... Q8_0); valid random blocks for the rest."""
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    tensors = {}
    for i, name in enumerate(QUANT_TYPES):
        k = 512
        try:
            raw = quantize(rng.normal(0, 0.02, size=(6, k)).astype(np.float32), gguf_type(name))
        except NotImplementedError:
            raw = random_gguf_rows(name, 6, k, seed=i)
        tensors[f"blk.{i}.ffn_down.weight"] = (raw, name)
    write_gguf(tmp_path / "every.gguf", tensors)
    weights = load_gguf_weights(tmp_path / "every.gguf")
    for i, (name, (raw, qtype)) in enumerate(tensors.items()):
        w = weights[f"model.layers.{i}.mlp.down_proj.weight"]
        assert isinstance(w, QuantWeight) and w.qtype == qtype and w.shape == (6, 512) and w.nbytes == raw.nbytes
        expected = gguf_dequantize(raw, gguf_type(qtype)).reshape(6, 512)
        assert torch.equal(dequantize(w), torch.from_numpy(np.ascontiguousarray(expected))), qtype


def test_embedded_model_stays_quantized_and_equals_its_float_conversion(embedded_dir):
    from ferry.model.gguf_convert import embedded_gguf_path
    from ferry.model.loader import load_safetensors

    quantized = load_gguf_weights(embedded_gguf_path())
    floats = load_safetensors(embedded_dir)
    assert set(quantized) == set(floats)
    resident = 0
    for name, w in quantized.items():
        if isinstance(w, QuantWeight):
            resident += w.nbytes
            assert torch.equal(dequantize(w), floats[name]), name
        else:
            resident += w.numel() * w.element_size()
            assert torch.equal(w, floats[name]), name
    assert sum(isinstance(w, QuantWeight) for w in quantized.values()) == 30 * 7 + 1
    assert resident < 150e6, resident


def test_a_type_the_kernels_lack_is_refused_by_name(tmp_path):
    # One TQ2_0 block row (256 weights, 66 bytes): a type ferry cannot keep quantized.
    write_gguf(tmp_path / "tq.gguf", {"blk.0.ffn_down.weight": (np.zeros((1, 66), dtype=np.uint8), "TQ2_0")})
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down\.weight' has GGUF type TQ2_0.*--quantization none"):
        load_gguf_weights(tmp_path / "tq.gguf")


def test_quantized_and_float_engines_agree(exact_llm, parity_prompts):
    """The engine keeps the GGUF quantized; quantization='none' runs the dequantized
    float32 model: the same greedy tokens on the parity prompts."""
    from ferry import LLM, SamplingParams

    assert exact_llm.engine.config.quantization is None and isinstance(exact_llm.engine.executor.model.layers[0].mixer.qkv, QuantWeight)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # Both compute every prompt from scratch: KV cached by earlier tests came from other batch
    # shapes, a few ulps apart, enough to flip a near-tie between the two models.
    exact_llm.engine.reset_prefix_cache()
    floats = LLM(quantization="none")
    assert isinstance(floats.engine.executor.model.layers[0].mixer.qkv, torch.Tensor)
    a = [o.outputs[0].token_ids for o in exact_llm.generate(parity_prompts, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in floats.generate(parity_prompts, sp, use_tqdm=False)]
    assert a == b


def test_quantization_gguf_needs_a_gguf_file(embedded_dir):
    from ferry import LLM

    with pytest.raises(ValueError, match="needs a .gguf model file"):
        LLM(model=str(embedded_dir), quantization="gguf")


def test_every_float16_scale_converts_exactly():
    """Q8_0 blocks whose scale walks all finite float16 values (subnormals, zeros, infinities)."""
    h = np.arange(65536, dtype=np.uint16)
    h = h[~np.isnan(h.view(np.float16))]
    raw = np.zeros((h.size, 34), dtype=np.uint8)
    raw[:, 0:2] = h.view(np.uint8).reshape(-1, 2)
    raw[:, 2:] = np.r_[-16:0, 1:17].astype(np.int8).view(np.uint8)  # no 0: inf * 0 is NaN
    w = repack(raw.reshape(1, -1), "Q8_0", (1, 32 * h.size))
    expected = gguf_dequantize(raw, gguf_type("Q8_0")).reshape(1, -1)
    assert torch.equal(dequantize(w), torch.from_numpy(np.ascontiguousarray(expected)))


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """A plain Q6_K quantizer for tests (the gguf library has none): rows of [n, k] -> blocks."""
    x = w.reshape(-1, 16, 16).astype(np.float32)  # super-blocks x 16 sub-blocks of 16
    s = np.abs(x).max(-1) / 31
    d = (s.max(-1, keepdims=True) / 127).astype(np.float16)
    sc = np.clip(np.round(s / np.maximum(d.astype(np.float32), 1e-30)), 1, 127).astype(np.int8)
    step = d.astype(np.float32)[..., None] * sc[..., None]
    q = (np.clip(np.round(x / step), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    halves = q.reshape(-1, 2, 2, 64)  # [half of 128, low or high nibble, 64]
    ql = (halves[:, :, 0] & 15) | ((halves[:, :, 1] & 15) << 4)
    quarters = q.reshape(-1, 2, 4, 32) >> 4  # [half, which 2-bit field, 32]
    qh = sum(quarters[:, :, i] << (2 * i) for i in range(4)).astype(np.uint8)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8)], axis=1)
    return out.reshape(w.shape[0], -1)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """A plain IQ4_NL quantizer for tests: each block's largest weight maps to -127."""
    from gguf.quants import IQ4_NL

    x = w.reshape(-1, 32).astype(np.float32)
    d = (np.take_along_axis(x, np.abs(x).argmax(-1)[:, None], -1) / -127).astype(np.float16)
    kv = np.array(IQ4_NL.kvalues, dtype=np.float32)
    q = np.abs(x[..., None] - d.astype(np.float32)[..., None] * kv).argmin(-1).astype(np.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8), qs], axis=1).reshape(w.shape[0], -1)


# Per layer of a two-layer cut of the embedded model, the types of its tensors (one type for q,
# k and v, and for gate and up, so the fused products stay quantized), like a Q4_K_M mix.
# Layer 0's attn_v is Q8_0 beside Q5_0 q and k, as llama.cpp's Q4_K_M writes it (a stack of two
# types); layer 1's gate and up differ too.
MIXED = [{"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_1", "ffn_gate": "Q8_0",
          "ffn_up": "Q8_0", "ffn_down": "Q6_K"},
         {"attn_q": "IQ4_NL", "attn_k": "IQ4_NL", "attn_v": "IQ4_NL", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
          "ffn_up": "Q5_0", "ffn_down": "Q4_K"}]


def write_mixed_gguf(path) -> None:
    """The embedded GGUF's first two layers, requantized per MIXED (Q4_K: valid random blocks)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    from ferry.model.gguf_convert import embedded_gguf_path

    reader = GGUFReader(str(embedded_gguf_path()))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = GGUFWriter(str(path), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = 2 if name == f"{arch}.block_count" else field.contents()
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and int(parts[1]) >= 2:
            continue
        qtype = MIXED[int(parts[1])].get(parts[2]) if parts[0] == "blk" else None
        if qtype is None:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        w = np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32)
        if qtype == "Q6_K":
            raw = quantize_q6_k(w)
        elif qtype == "IQ4_NL":
            raw = quantize_iq4_nl(w)
        elif qtype == "Q4_K":
            raw = random_gguf_rows("Q4_K", w.shape[0], w.shape[1], seed=1)
            raw.reshape(w.shape[0], -1, 144)[..., 0:4] = np.full(2, 2e-5, np.float16).view(np.uint8)
        else:
            raw = quantize(w, gguf_type(qtype))
        writer.add_tensor(t.name, raw, raw_dtype=gguf_type(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_mixed_file_generates_as_its_dequantized_copy(tmp_path, monkeypatch, parity_prompts):
    """Seven types in one model, kept quantized: the same greedy tokens as the float32 model the
    gguf library dequantizes from the same file (quantization none)."""
    from ferry import LLM, SamplingParams

    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "mixed-q4km.gguf"
    write_mixed_gguf(path)
    quant = LLM(model=str(path), quant_activations="exact")
    layers = quant.engine.executor.model.layers
    kinds = [(l.mixer.qkv.qtype, l.mixer.o_proj.qtype, l.mlp.gate_up.qtype, l.mlp.down.qtype) for l in layers]
    def stacked(*types: str) -> str:
        return "+".join(t for i, t in enumerate(types) if i == 0 or t != types[i - 1])
    assert kinds == [(stacked(m["attn_q"], m["attn_k"], m["attn_v"]), m["attn_output"],
                      stacked(m["ffn_gate"], m["ffn_up"]), m["ffn_down"]) for m in MIXED]
    conv = quant.engine.executor.model_dir
    assert not (conv / "model.safetensors").exists()  # served quantized: no float32 copy written
    floats = LLM(model=str(path), quantization="none")
    assert floats.engine.executor.model_dir == conv and (conv / "model.safetensors").is_file()  # on demand
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = parity_prompts[:4]
    a = [o.outputs[0].token_ids for o in quant.generate(prompts, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in floats.generate(prompts, sp, use_tqdm=False)]
    assert a == b and len({tuple(t) for t in a}) > 1
    # One request alone: the fused decode's one-row products, a stack's parts into their columns.
    one = [quant.generate(prompts[:1], sp, use_tqdm=False)[0].outputs[0].token_ids,
           floats.generate(prompts[:1], sp, use_tqdm=False)[0].outputs[0].token_ids]
    assert one[0] == one[1]


def test_k_quant_shards_cut_on_super_blocks():
    """Tensor-parallel MLP cuts fall on 256-weight edges where the size allows, so a K-quant
    down projection's column shards stay quantized and equal the float columns."""
    from ferry.model.shard_plan import split
    from ferry.model.tensor_parallel import shard_cols

    w = repack(random_gguf_rows("Q6_K", 8, 1536, seed=3), "Q6_K", (8, 1536))
    full = dequantize(w)
    for rank in range(4):
        start, end = split(1536, 4, rank, 256)
        part = shard_cols(w, start, end)
        assert isinstance(part, QuantWeight) and torch.equal(dequantize(part), full[:, start:end])
    off = shard_cols(w, 32, 320)  # not on a super-block: that shard is dequantized
    assert isinstance(off, torch.Tensor) and torch.equal(off, full[:, 32:320])


def each_q8_isa(names=Q8_ISAS):
    """Switch the q8 kernels to each variant of ``names`` this CPU runs, yielding its name; the
    variant in use before is restored afterwards, however the loop ends."""
    best = q8_isa()
    try:
        for isa in names:
            try:
                q8_isa(isa)
            except ValueError:
                continue  # this CPU lacks it
            yield isa
    finally:
        q8_isa(best)


def q8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the q8 mode sees it (per 32: scale amax / 127, levels rounded half away from zero),
    and each element's scale."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, blocks / torch.where(d > 0, d, 1), 0)
    q = torch.sign(q) * torch.floor(q.abs() + 0.5)
    return (q * d).reshape(x.shape), d.expand_as(blocks).reshape(x.shape)


@pytest.mark.parametrize("m", [1, 3, 7, 32])
@pytest.mark.parametrize("qtype,n,k", [c for c in CASES if c[1] > 1])
def test_q8_products_are_the_int8_activations_and_within_their_bound(qtype, m, n, k):
    """q8: the product of the int8-rounded activations with the dequantized weight (up to the order
    of sums), so within |w| @ (scale / 2) of exact: each activation moves by at most half its step.
    Past KERNEL_ROWS rows (a prefill chunk) the same integer products, the same bits per row."""
    w = repack(random_gguf_rows(qtype, n, k, seed=m * n + k), qtype, (n, k), )
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    wf = dequantize(w)
    exact = x @ wf.t()
    w.activations = "q8"
    y = quant_linear(x, w)
    xq, step = q8_activations(x)
    scale = float((xq.abs() @ wf.abs().t()).max())
    torch.testing.assert_close(y, xq @ wf.t(), rtol=1e-4, atol=2e-5 * scale)
    many = torch.randn(KERNEL_ROWS + 1, k, generator=torch.Generator().manual_seed(m))
    many[:m] = x  # the same rows give the same products, whichever path serves them
    y_many = quant_linear(many, w)
    torch.testing.assert_close(y_many, q8_activations(many)[0] @ wf.t(), rtol=1e-4, atol=2e-5 * scale)
    assert torch.equal(y_many[:m], y)
    bound = 0.5 * step @ wf.abs().t() + 2e-5 * scale
    assert bool(((y - exact).abs() <= bound).all())


@pytest.mark.parametrize("qtype", sorted(QUANT_TYPES))
def test_every_q8_variant_this_cpu_runs_equals_the_portable_one(qtype):
    # An odd count of 32-blocks and 37 rows: a ragged last tile of 8 and of 16 lanes.
    n, k = (37, 544) if QUANT_TYPES[qtype].block == 32 else SHAPES[qtype][-1]
    raw = random_gguf_rows(qtype, n, k, seed=5).reshape(n, k // QUANT_TYPES[qtype].block, -1)
    lo, hi = SCALE_FIELDS[qtype]
    for row, fill in enumerate((0x00, 0xFF, 0x80, 0x77)):  # every level at an extreme: no int16 may saturate
        scales = raw[row, :, lo:hi].copy()
        raw[row] = fill
        raw[row, :, lo:hi] = scales
    w = repack(raw.reshape(n, -1), qtype, (n, k))
    w.activations = "q8"
    p = packed(w)  # the layout a model's q8 weights run in (packed by 16 rows where the type packs)
    # One row, a decode batch's rows (R = 4 rows a pass and a tail) and a prefill chunk's; rows of
    # +127 and -127 levels against the extreme weights, and one of tiny values.
    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(2)) for m in (1, 9, 40)]
    xs[1][0], xs[1][1] = 1.0, -1.0
    xs[1][2] *= 1e-38  # scales below FLT_MIN: their blocks are zeros in every variant
    refs = [quant_linear(x, w) for _ in each_q8_isa(["portable"]) for x in xs]
    ran = []
    for isa in each_q8_isa(Q8_ISAS[1:]):
        ran.append(isa)
        for x, ref in zip(xs, refs):
            assert torch.equal(quant_linear(x, p), ref), (isa, x.shape[0])
    assert "avx2" in ran or not torch.backends.cpu.get_cpu_capability().startswith("AVX")


@pytest.mark.parametrize("qtype", sorted(QUANT_TYPES))
def test_a_q8_row_gets_the_same_bits_in_any_batch(qtype):
    """q8 products make each output lane by lane in one order (kernels/quant_q8.c), so a row's
    result is the same bits alone (a decode of one request), among a decode batch's rows or in a
    prefill chunk, wherever it sits in the group of weight rows and the pass of activation rows."""
    n, k = (37, 544) if QUANT_TYPES[qtype].block == 32 else SHAPES[qtype][-1]
    w = repack(random_gguf_rows(qtype, n, k, seed=7), qtype, (n, k))
    w.activations = "q8"
    p = packed(w)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(3))
    whole = quant_linear(x, p)
    for lo, hi in ((0, 1), (0, 2), (0, 5), (3, 12), (57, 58), (20, 53)):
        assert torch.equal(quant_linear(x[lo:hi], p), whole[lo:hi]), (lo, hi)
    rows = torch.tensor([5, 30, 1, 17])
    some = packed(QuantWeight(w.data[rows].contiguous(), w.qtype, (4, k), "q8"))
    assert torch.equal(quant_linear(x, some), whole[:, rows])


def test_a_q8_engine_stays_close_to_the_exact_one(exact_llm, llm, parity_prompts):
    """quant_activations='q8', the default, reaches every quantized product (the fused decode too):
    the model's next-token choices mostly agree with exact mode's (whose KV cache is float32, q8's
    float16), and its logprobs move little but do move."""
    from ferry import LLM, SamplingParams
    from ferry.bench.accuracy import compare

    q8 = llm
    assert q8.engine.config.quant_activations == "q8" and q8.engine.executor.model.layers[0].mixer.qkv.activations == "q8"
    assert exact_llm.engine.executor.model.layers[0].mixer.qkv.activations == "exact"
    stats = compare(exact_llm, q8, parity_prompts[:4])
    assert stats["top1_agreement"] > 0.9 and 0 < stats["mean_abs_logprob_diff"] < 0.2, stats
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert all(len(o.outputs[0].token_ids) == 8 for o in q8.generate(parity_prompts[:2], sp, use_tqdm=False))
    # kv_cache_dtype 'auto': llama.cpp's float16 under its products, the model's float32 in exact mode.
    assert q8.engine.executor.kv_caches[0][0].dtype == torch.float16
    assert exact_llm.engine.executor.kv_caches[0][0].dtype == torch.float32
    assert LLM(kv_cache_dtype="float32", num_kv_blocks=4).engine.executor.kv_caches[0][0].dtype == torch.float32
    with pytest.raises(ValueError, match="quant_activations must be 'exact' or 'q8'"):
        LLM(quant_activations="int4")


def test_kernels_built_for_avx2_only_give_the_same_products():
    """FERRY_KERNEL_ARCH=haswell (AVX2 + FMA, what most users' CPUs have; 8 float lanes) builds
    another library: its dequantization is gguf's bit for bit and its products agree, for every type."""
    import subprocess
    import sys

    check = """
import sys, torch
sys.path.insert(0, "tests")
from test_quant import CASES, random_gguf_rows, gguf_type, gguf_dequantize
from ferry.model.quant import repack, dequantize, quant_linear
from ferry.model.kernels import ARCH
assert ARCH == "-march=haswell", ARCH
torch.manual_seed(0)
for qtype, n, k in CASES:
    raw = random_gguf_rows(qtype, n, k, seed=3)
    w = repack(raw, qtype, (n, k))
    ref = torch.from_numpy(gguf_dequantize(raw, gguf_type(qtype)).reshape(n, k).copy())
    assert torch.equal(dequantize(w), ref), qtype
    for m in (1, 5, 40):
        x = torch.randn(m, k)
        want = x @ ref.t()
        torch.testing.assert_close(quant_linear(x, w), want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
print("ok", len(CASES))
"""
    env = {**__import__("os").environ, "FERRY_KERNEL_ARCH": "haswell"}
    from pathlib import Path

    r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).parents[1])
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]
