"""GGUF weights kept quantized: the kernel's products equal dequantize-then-matmul, the repacked
weights dequantize bit for bit as the gguf library does, and unsupported types are refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from ferry.model.kernels import load_kernels
from ferry.model.quant import KERNEL_TYPES, QuantWeight, cat_rows, dequantize, load_gguf_weights, quant_linear, repack

# GGUF's own (weights, bytes) per block, float16 scales first: what a .gguf file holds.
GGUF_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144)}
# Shapes (N, K) per type: K a multiple of the type's block.
SHAPES = {t: [(1, 32), (5, 96), (37, 576), (258, 1536)] for t in ("Q4_0", "Q4_1", "Q8_0")}
SHAPES["Q4_K"] = [(1, 256), (37, 512), (258, 1536)]
CASES = [(t, n, k) for t in sorted(SHAPES) for n, k in SHAPES[t]]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if load_kernels() is None:
        pytest.fail("the kernels could not be built (no C compiler?)")


def random_gguf_rows(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """n rows of k weights as a GGUF file stores them: random quants, float16 scales of either sign."""
    rng = np.random.default_rng(seed)
    weights, nbytes = GGUF_BLOCK[qtype]
    blocks = rng.integers(0, 256, size=(n, k // weights, nbytes), dtype=np.uint8)
    scales = 4 if qtype in ("Q4_1", "Q4_K") else 2  # d (and m, or dmin)
    blocks[..., :scales] = rng.normal(0, 0.02, size=(n, k // weights, scales // 2)).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def gguf_type(qtype: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[qtype]


@pytest.mark.parametrize("qtype,n,k", CASES + [("Q4_1", 131, 64), ("Q8_0", 300, 1536)])
def test_repacked_weights_dequantize_as_gguf_does(qtype, n, k):
    raw = random_gguf_rows(qtype, n, k, seed=n + k)
    w = repack(raw, qtype, (n, k))
    expected = gguf_dequantize(raw, gguf_type(qtype)).reshape(n, k)
    assert torch.equal(dequantize(w), torch.from_numpy(np.ascontiguousarray(expected)))
    rows = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(dequantize(w, rows), torch.from_numpy(np.ascontiguousarray(expected))[rows])


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 31, 32, 33, 100])
@pytest.mark.parametrize("qtype,n,k", CASES)
def test_products_equal_dequantize_then_matmul(qtype, m, n, k):
    """Every path (fused for few rows, buffered, dequantize-then-BLAS), ragged M and N (not
    multiples of the register blocks) and K of 1 to 48 blocks."""
    w = repack(random_gguf_rows(qtype, n, k, seed=m * n + k), qtype, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = quant_linear(x, w)
    assert y.shape == (m, n) and y.is_contiguous()
    ref = x @ dequantize(w).t()
    # Sums of up to 1536 terms in another order: float32 rounding relative to the outputs' size.
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))


def test_fused_rows_stack_like_their_parts():
    a = repack(random_gguf_rows("Q4_1", 40, 64, 1), "Q4_1", (40, 64))
    b = repack(random_gguf_rows("Q4_1", 8, 64, 2), "Q4_1", (8, 64))
    c = repack(random_gguf_rows("Q8_0", 8, 64, 3), "Q8_0", (8, 64))
    both = cat_rows([a, b])
    assert isinstance(both, QuantWeight) and both.shape == (48, 64)
    assert torch.equal(dequantize(both), torch.cat([dequantize(a), dequantize(b)]))
    mixed = cat_rows([a, c])  # different types: float32
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed, torch.cat([dequantize(a), dequantize(c)]))


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


def test_a_type_the_kernel_lacks_is_refused_by_name(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "k-quant.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    # One Q6_K super-block row (256 weights, 210 bytes): a type ferry cannot keep quantized.
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((1, 210), dtype=np.uint8),
                      raw_dtype=gguf_type("Q6_K"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down\.weight' has GGUF type Q6_K.*--quantization none"):
        load_gguf_weights(path)


def test_quantized_and_float_engines_agree(llm, parity_prompts):
    """The default engine keeps the GGUF quantized; quantization='none' runs the dequantized
    float32 model: the same greedy tokens on the parity prompts."""
    from ferry import LLM, SamplingParams

    assert llm.engine.config.quantization is None and isinstance(llm.engine.executor.model.layers[0].qkv, QuantWeight)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # Both compute every prompt from scratch: KV cached by earlier tests came from other batch
    # shapes, a few ulps apart, enough to flip a near-tie between the two models.
    llm.engine.reset_prefix_cache()
    floats = LLM(quantization="none")
    assert isinstance(floats.engine.executor.model.layers[0].qkv, torch.Tensor)
    a = [o.outputs[0].token_ids for o in llm.generate(parity_prompts, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in floats.generate(parity_prompts, sp, use_tqdm=False)]
    assert a == b


def test_quantization_gguf_needs_a_gguf_file(embedded_dir):
    from ferry import LLM

    with pytest.raises(ValueError, match="needs a .gguf model file"):
        LLM(model=str(embedded_dir), quantization="gguf")


def test_a_q4_k_file_loads_quantized(tmp_path):
    """K-quant super-blocks become the kernel's Q4_1 blocks, read from a real GGUF file."""
    from gguf import GGUFWriter

    raw = random_gguf_rows("Q4_K", 8, 512, seed=7)
    path = tmp_path / "q4k.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=gguf_type("Q4_K"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    w = load_gguf_weights(path)["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(w, QuantWeight) and w.shape == (8, 512) and w.kernel_type == KERNEL_TYPES["Q4_1"][0]
    expected = gguf_dequantize(raw, gguf_type("Q4_K")).reshape(8, 512)
    assert torch.equal(dequantize(w), torch.from_numpy(np.ascontiguousarray(expected)))
