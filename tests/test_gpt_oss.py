"""gpt-oss from GGUF files whose experts are MXFP4 (GGML type 39: an E8M0 scale byte and 32 E2M1
codes a block), kept in their blocks: written by the gguf library, and made by llama.cpp's own
llama-quantize (MXFP4_MOE: experts MXFP4, the other matrices Q8_0). Each against transformers
holding the file's weights dequantized by the gguf library (the safetensors and F32 GGUF parity of
the architecture is tests/test_architectures.py's)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ferry.model.kernels import load_kernels
from ferry.model.quant import QuantWeight
from tests.arch_models import gguf_model, hf_logprobs, make_model, write_gguf
from tests.test_architectures import PROMPTS, TOL, engine, max_logprob_diff

LLAMA_BIN = Path("/work/peers/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model("gpt-oss", tmp_path_factory.mktemp("gpt-oss"))


def check_file(model, gguf: Path, expert_type: str) -> None:
    """Kept in its blocks (experts in ``expert_type``) and converted to float, the file's model
    matches transformers on the file's dequantized weights."""
    ref_model = gguf_model(model, gguf)
    refs = [hf_logprobs(ref_model, p) for p in PROMPTS]
    kept = engine(str(gguf), quantization="gguf")
    experts = kept.engine.executor.model.layers[0].mlp
    assert isinstance(experts.gate_up[0], QuantWeight) and experts.gate_up[0].qtype == expert_type
    assert isinstance(experts.down[0], QuantWeight) and experts.down[0].qtype == expert_type
    diff = max_logprob_diff(kept, refs)
    plain = max_logprob_diff(engine(str(gguf), quantization="none"), refs)
    far = max(float((r - hf_logprobs(model, p)).abs().max()) for r, p in zip(refs, PROMPTS))
    print(f"{gguf.name}: max |d logprob| vs the dequantized reference {diff:.2e} (blocks), {plain:.2e} "
          f"(float); the quantization moved the reference by {far:.2e}")
    assert diff < TOL and plain < TOL
    assert far > 10 * TOL  # the reference is the quantized model's, not the float one's


def test_mxfp4_experts_from_the_gguf_library_run_on_their_blocks(model, tmp_path, monkeypatch):
    if load_kernels() is None:
        pytest.skip("no C kernels here: quantized weights are dequantized")
    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    check_file(model, write_gguf(model, tmp_path / "gpt-oss-mxfp4.gguf", experts="MXFP4"), "MXFP4")


def test_a_llama_quantize_mxfp4_moe_file_runs_on_its_blocks(model, tmp_path, monkeypatch):
    tool = LLAMA_BIN / "llama-quantize"
    if load_kernels() is None or not tool.is_file():
        pytest.skip("needs the C kernels and llama.cpp's llama-quantize")
    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    f32, out = write_gguf(model, tmp_path / "gpt-oss-f32.gguf"), tmp_path / "gpt-oss-mxfp4-moe.gguf"
    env = dict(os.environ, LD_LIBRARY_PATH=str(LLAMA_BIN))
    subprocess.run([str(tool), str(f32), str(out), "MXFP4_MOE"], check=True, capture_output=True, env=env, timeout=120)
    check_file(model, out, "MXFP4")
    layer = engine(str(out), quantization="gguf").engine.executor.model.layers[0]
    assert layer.mixer.qkv.qtype == "Q8_0"


def test_tensor_parallelism_is_refused_naming_the_biases():
    """The o and experts' down biases follow products whose columns tensor parallelism cuts: every
    rank would add them, so such a model is refused over several ranks, by name."""
    from ferry.model.config import ModelConfig
    from ferry.model.shard_plan import ShardPlan
    from tests.arch_models import hf_config

    cfg = ModelConfig.from_dict(hf_config("gpt-oss").to_dict())
    assert ShardPlan.make(cfg, 0, 1).world == 1
    with pytest.raises(ValueError, match="GptOssForCausalLM's output and experts' biases"):
        ShardPlan.make(cfg, 0, 2)
