"""gpt-oss from GGUF files whose experts are MXFP4 (GGML type 39: an E8M0 scale byte and 32 E2M1
codes a block), kept in their blocks: written by the gguf library, and made by llama.cpp's own
llama-quantize (MXFP4_MOE: experts MXFP4, the other matrices Q8_0). Each against transformers
holding the file's weights dequantized by the gguf library (the safetensors and F32 GGUF parity of
the architecture is tests/test_architectures.py's). Also a safetensors checkpoint whose experts are
MXFP4 blocks as the published ones store them, and the fused C decode against the torch path."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ferry import LLM
from ferry.model.kernels import load_kernels
from ferry.model.quant import QuantWeight
from tests.arch_models import gguf_model, hf_logprobs, make_model, write_gguf
from tests.llama_cpp import LLAMA_BIN
from tests.test_architectures import PROMPTS, TOL, engine, max_logprob_diff



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpt-oss")


@pytest.fixture(scope="module")
def model(model_dir):
    return make_model("gpt-oss", model_dir)


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


def _decode(llm, monkeypatch) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Greedy tokens and their logprobs of PROMPTS decoded together, and how many fused decode calls ran."""
    from ferry import SamplingParams
    from ferry.model.fused_decode import FusedDecode

    calls = []
    run = FusedDecode.run
    monkeypatch.setattr(FusedDecode, "run", lambda self, *a, **k: calls.append(1) or run(self, *a, **k))
    sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    return ([o.token_ids for o in outs], [torch.tensor([o.logprobs[j][t] for j, t in enumerate(o.token_ids)])
                                          for o in outs], len(calls))


@pytest.mark.parametrize("experts", [None, "MXFP4"])
def test_decode_steps_run_in_the_fused_c_decode_as_the_torch_path_does(model, model_dir, experts, tmp_path,
                                                                        monkeypatch):
    """Sinks, alternating windows, q/k/v/o biases and the routed experts (router bias, softmax over the
    top k, gate/up/down biases, clamped SwiGLU), in float and in MXFP4 blocks: three requests decode
    together in the fused C decode, with the torch path's tokens and logprobs."""
    if load_kernels() is None:
        pytest.skip("no C kernels here: the model decodes through torch")
    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    path = str(model_dir) if experts is None else str(write_gguf(model, tmp_path / "mxfp4.gguf", experts=experts))
    kw = dict(quantization="gguf", quant_activations="q8") if experts else dict(quant_activations="exact")
    fused = LLM(model=path, max_num_seqs=3, block_size=4, **kw)
    assert fused.engine.executor.model.fused is not None
    # MXFP4 experts multiply packed by 16 rows (quant_q8_packed.c) in prefill and decode alike.
    mlp = fused.engine.executor.model.layers[0].mlp
    assert all(isinstance(w, QuantWeight) and w.packed for w in [*mlp.gate_up, *mlp.down]) == bool(experts)
    tokens, logprobs, calls = _decode(fused, monkeypatch)
    assert calls >= 11  # every decode step after the prompts'
    torch_path = LLM(model=path, max_num_seqs=3, block_size=4, **kw)
    torch_path.engine.executor.model.fused = None
    want_tokens, want_logprobs, none = _decode(torch_path, monkeypatch)
    assert none == 0 and tokens == want_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logprobs, want_logprobs)) < 1e-4


def _hf_mxfp4(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] float weights quantized to MXFP4 by the gguf library (llama.cpp's rule), in the
    published checkpoint's layout: blocks [E, out, in / 32, 16] (codes 2j, 2j + 1 in byte j's low and
    high nibbles) and E8M0 scales [E, out, in / 32]."""
    import gguf

    e, n, k = w.shape
    ggml = gguf.quants.quantize(np.ascontiguousarray(w.reshape(e * n, k), dtype=np.float32),
                                gguf.GGMLQuantizationType.MXFP4).reshape(e, n, k // 32, 17)
    codes = np.concatenate([ggml[..., 1:] & 15, ggml[..., 1:] >> 4], axis=-1)  # the block's 32 codes in order
    return torch.from_numpy(codes[..., 0::2] | (codes[..., 1::2] << 4)), torch.from_numpy(ggml[..., 0].copy())


def test_a_checkpoint_with_mxfp4_experts_runs_on_its_blocks(model, model_dir, tmp_path):
    """The published checkpoints' experts: ``*_blocks`` (uint8) and ``*_scales`` (E8M0) per expert,
    here transformers' float experts quantized so; kept in their MXFP4 blocks, the model matches
    transformers running the same blocks dequantized (transformers' own conversion)."""
    import copy
    import json

    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors


    if load_kernels() is None:
        pytest.skip("no C kernels here: the experts are dequantized")
    ref, tensors = copy.deepcopy(model), {}
    for name, p in model.state_dict().items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = p.contiguous()
            continue
        blocks, scales = _hf_mxfp4(p.transpose(1, 2).numpy())  # rows: output features
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        ref.get_parameter(name).data.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    out = tmp_path / "mxfp4"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    refs = [hf_logprobs(ref, p) for p in PROMPTS]
    llm = LLM(model=str(out), quant_activations="exact", max_num_seqs=3, block_size=4)
    experts = llm.engine.executor.model.layers[0].mlp
    assert isinstance(experts.gate_up[0], QuantWeight) and experts.gate_up[0].qtype == "MXFP4"
    assert isinstance(experts.down[0], QuantWeight) and experts.down[0].qtype == "MXFP4"
    diff = max_logprob_diff(llm, refs)
    far = max(float((r - hf_logprobs(model, p)).abs().max()) for r, p in zip(refs, PROMPTS))
    print(f"MXFP4 checkpoint: max |d logprob| {diff:.2e}; the quantization moved the reference by {far:.2e}")
    assert diff < 1e-4 and far > 100 * 1e-4
