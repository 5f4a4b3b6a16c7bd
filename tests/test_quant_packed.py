"""Weights packed by 16 rows for the q8 products (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS,
MXFP4;
kernels/quant_q8_packed.c): the file's bytes permuted, the same products bit for bit in every
instruction-set variant and at every M, and what a q8 model packs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ferry.model.quant import QUANT_TYPES, packable, RowStack, dequantize, pack_rows16, packed, \
    quant_linear, repack, unpack_rows16
from tests.test_quant import SCALE_FIELDS, each_q8_isa, random_gguf_rows, write_mixed_gguf

PACKED = [t for t in QUANT_TYPES if packable(t)]
SHAPES = {32: [(1, 32), (15, 96), (16, 64), (17, 576), (37, 544)], 256: [(1, 256), (15, 512), (17, 768), (37, 1536)]}
CASES = [(t, n, k) for t in PACKED for n, k in SHAPES[QUANT_TYPES[t].block]]


def extreme_rows(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random blocks, and rows whose every quant byte is at an extreme (4-bit levels 0 and 15, Q8_0's
    -128, -1 and 127; Q5's fifth bits all set or clear), against which no int16 may saturate."""
    raw = random_gguf_rows(qtype, n, k, seed).reshape(n, k // QUANT_TYPES[qtype].block, -1)
    lo, hi = SCALE_FIELDS[qtype]
    for row, fill in list(enumerate((0x00, 0xFF, 0xF0, 0x0F, 0x80, 0x7F)))[:n]:
        scales = raw[row, :, lo:hi].copy()
        raw[row] = fill
        raw[row, :, lo:hi] = scales
    return raw.reshape(n, -1)


def test_the_packed_types_are_every_32_block_and_super_block_type():
    assert PACKED == ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
                      "MXFP4"]


@pytest.mark.parametrize("qtype,n,k", CASES)
def test_packing_permutes_the_file_s_bytes_and_unpacks_to_them(qtype, n, k):
    w = repack(random_gguf_rows(qtype, n, k, seed=n + k), qtype, (n, k))
    p = pack_rows16(w)
    assert p.packed and p.shape == w.shape and p.data.shape[0] == -(-n // 16) * 16
    pad = p.data.numel() - w.data.numel()  # the last group's missing rows: zero bytes
    assert np.array_equal(np.sort(p.data.numpy().ravel()),
                          np.sort(np.concatenate([w.data.numpy().ravel(), np.zeros(pad, np.uint8)])))
    assert torch.equal(unpack_rows16(p).data, w.data)
    assert torch.equal(dequantize(p), dequantize(w))
    rows = torch.tensor([n - 1, 0])
    assert torch.equal(dequantize(p, rows), dequantize(w, rows))


@pytest.mark.parametrize("qtype,n,k", CASES)
def test_packed_products_are_the_file_layout_s_bits_in_every_variant(qtype, n, k):
    """Every variant this CPU runs, the portable one first (AMX's tile products too), at one row, a
    decode batch's (4 rows a pass and a tail) and a prefill chunk's: packed products equal the file
    layout's, bit for bit."""
    w = repack(extreme_rows(qtype, n, k, seed=3), qtype, (n, k))
    w.activations = "q8"
    p = pack_rows16(w)
    # 12 and 27: AMX passes of fewer than 16 rows (one alone, one after a full tile); 40: a vector tail.
    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in (1, 2, 3, 4, 5, 9, 12, 27, 40)]
    xs[-1][0], xs[-1][1] = 1.0, -1.0  # rows of +127 and -127 levels against the extreme weights
    ran = []
    for isa in each_q8_isa():
        ran.append(isa)
        for x in xs:
            assert torch.equal(quant_linear(x, p), quant_linear(x, w)), (isa, x.shape[0])
    assert "portable" in ran and ("avx2" in ran or not torch.backends.cpu.get_cpu_capability().startswith("AVX"))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q6_K"])
def test_packed_products_walk_wide_weights_in_chunks_with_the_same_bits(qtype):
    """A weight whose groups of 16 rows span several of the kernel's 128 KB chunks on each of two
    threads (K = 4096: 2-3 groups a chunk, 23 groups, the last of 11 rows): 40 rows (10 passes of
    4, the Q5 / Q6 types' levels decoded once per chunk; AMX: two tiles and a tail) give the file
    layout's bits in every variant."""
    n, k = 23 * 16 - 5, 4096
    w = repack(extreme_rows(qtype, n, k, seed=5), qtype, (n, k))
    w.activations = "q8"
    p = pack_rows16(w)
    # 130 rows: AMX decodes every type's levels once for its eight tile passes (and a vector tail).
    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(9)) for m in (40, 130)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # more threads would give each fewer groups than two chunks
    try:
        for isa in each_q8_isa():
            for x in xs:
                assert torch.equal(quant_linear(x, p), quant_linear(x, w)), (isa, x.shape[0])
    finally:
        torch.set_num_threads(threads)


def test_packed_picks_q8_weights_of_the_table_s_types_and_nothing_else(monkeypatch):
    import ferry.model.quant as quant

    # Every type has a layout now: IQ4_XS stands for a type the table might not pack.
    monkeypatch.setattr(quant, "packable", lambda qtype: qtype != "IQ4_XS")
    q41 = repack(random_gguf_rows("Q4_1", 16, 256, 1), "Q4_1", (16, 256))
    iq4xs = repack(random_gguf_rows("IQ4_XS", 16, 256, 2), "IQ4_XS", (16, 256))
    f32 = torch.randn(16, 256)
    assert packed(q41) is q41 and packed(f32) is f32  # exact mode: the file's layout; floats as they are
    q41.activations = iq4xs.activations = "q8"
    assert packed(q41).packed and packed(iq4xs) is iq4xs
    stack = packed(RowStack([q41, iq4xs]))
    assert [p.packed for p in stack.parts] == [True, False]
    p = packed(q41)
    p.activations = "exact"
    with pytest.raises(ValueError, match="packed by 16 rows multiplies in q8 mode only"):
        quant_linear(torch.randn(1, 256), p)
    with pytest.raises(ValueError, match="only unpacked"):
        pack_rows16(iq4xs)
    with pytest.raises(ValueError, match="only unpacked"):
        pack_rows16(packed(q41))
    from ferry.model.quant import cat_rows
    from ferry.model.tensor_parallel import shard_cols, shard_rows

    with pytest.raises(ValueError, match="cannot be stacked"):
        cat_rows([packed(q41), q41])
    for cut in (shard_rows, shard_cols):
        with pytest.raises(ValueError, match="cannot be sharded"):
            cut(packed(q41), 0, 32 if cut is shard_cols else 8)


def test_a_q8_model_packs_its_q4_layers_and_generates_as_unpacked(tmp_path, monkeypatch, parity_prompts):
    """The mixed file in q8 mode: every weight packed (a stack's Q5_0 q/k and Q8_0 v parts, Q4_1 gate
    and Q5_0 up, IQ4_NL, Q6_K, Q4_K, and the tied Q8_0 LM head, whose embedding lookups gather from
    the records), and the same
    greedy tokens and logprobs, bit for bit, as the same model with packing off, batched and one
    request alone (the fused decode's one-row products)."""
    from ferry import LLM, SamplingParams

    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "mixed.gguf"
    write_mixed_gguf(path)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = parity_prompts[:4]

    def run(llm):
        outs = llm.generate(prompts, sp, use_tqdm=False) + llm.generate(prompts[:1], sp, use_tqdm=False)
        return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]

    q8 = LLM(model=str(path), quant_activations="q8")
    model = q8.engine.executor.model
    first, second = model.layers
    assert [p.packed for p in first.mixer.qkv.parts] == [True, True] and first.mixer.o_proj.packed
    assert first.mlp.gate_up.packed and first.mlp.down.packed and second.mlp.down.packed  # Q6_K, Q4_K
    assert second.mixer.qkv.packed and second.mixer.o_proj.packed
    assert [p.packed for p in second.mlp.gate_up.parts] == [True, True]
    assert model.lm_head is model.embed and model.embed.packed
    want = run(q8)
    del q8
    for where in ("ferry.model.decoder", "ferry.model.layers.attention", "ferry.model.layers.mlp"):
        monkeypatch.setattr(f"{where}.packed", lambda w: w)
    plain = LLM(model=str(path), quant_activations="q8")
    assert not plain.engine.executor.model.layers[1].mixer.o_proj.packed
    assert run(plain) == want


def test_mxfp4_packed_products_take_every_scale_byte_as_the_file_layout_does():
    """MXFP4's E8M0 scales, the subnormal ones (bytes 0 and 1) and those up to 2^2 among them: the
    packed products equal the file layout's, bit for bit, in every variant."""
    n, k = 37, 32 * 136
    raw = random_gguf_rows("MXFP4", n, k, seed=11).reshape(n, k // 32, 17)
    raw[..., 0] = np.arange(n * k // 32).reshape(n, k // 32) % 131  # every byte 0..130
    w = repack(raw.reshape(n, -1), "MXFP4", (n, k))
    w.activations = "q8"
    p = pack_rows16(w)
    for isa in each_q8_isa():
        for m in (1, 3, 6):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            assert torch.equal(quant_linear(x, p), quant_linear(x, w)), (isa, m)
