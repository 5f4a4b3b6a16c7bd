"""The device-agnostic path: device and dtype resolution, KV sizing from GPU memory, and the
engine on every available device (the CPU always; CUDA when torch sees a GPU) with the pure-torch
backend the CUDA path uses: parity with transformers and batching invariance."""
from __future__ import annotations

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.config import EngineConfig
from ferry.model.device import default_dtype, kv_blocks_for_memory, resolve_device

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not CUDA, reason="no CUDA GPU here: the CUDA path is checked on a GPU by scripts/gpu_check.sh"))]


def test_device_and_dtype_resolution(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.delenv("FERRY_DEVICE", raising=False)
    assert resolve_device("auto") == torch.device("cuda" if CUDA else "cpu")
    monkeypatch.setenv("FERRY_DEVICE", "cpu")
    assert resolve_device("auto") == torch.device("cpu")
    assert default_dtype(torch.device("cpu")) == "float32"
    if not CUDA:
        with pytest.raises(ValueError, match="device 'cuda' asked for, but torch sees no CUDA GPU"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda', got 'gpu'"):
        EngineConfig(device="gpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_kv_cache_is_sized_from_gpu_memory_as_vllm_does():
    gib = 2**30
    # 80 GiB card, 2 GiB already used (weights), 90%: 72 GiB - 2 - 1 (activations) = 69 GiB of blocks.
    assert kv_blocks_for_memory(80 * gib, 78 * gib, 0.9, gib // 4, gib) == 69 * 4
    with pytest.raises(ValueError, match="no room for a KV cache"):
        kv_blocks_for_memory(8 * gib, 2 * gib, 0.5, gib // 4, gib)


def _tiny_model(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=299, bos_token_id=1)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(25.0)  # peaked logits: no near-ties between implementations
    model.save_pretrained(str(path), safe_serialization=True)
    return model


@pytest.mark.parametrize("device", DEVICES)
def test_engine_on_device_matches_transformers_and_any_batching(device, tmp_path):
    hf = _tiny_model(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 299, (n,), generator=g).tolist() for n in (3, 17, 40, 77, 130)]
    n_new = 20
    with torch.inference_mode():
        ref = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)

    def engine(**kw) -> LLM:
        llm = LLM(model=str(tmp_path), device=device, dtype="float32", **kw)
        model = llm.engine.executor.model
        model.use_kernel, model.fused = False, None  # the pure-torch backend, as on CUDA
        return llm

    llm = engine()
    ex = llm.engine.executor
    assert llm.engine.config.device == device and llm.engine.config.dtype == "float32"
    assert ex.kv_caches[0][0].device.type == device and ex.model.embed.device.type == device
    assert ex.model.ropes[0][0].device.type == device
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert together == ref
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert alone == ref
    chunked = engine(max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, sp, use_tqdm=False)] == ref
    tight = engine(num_kv_blocks=16, max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, sp, use_tqdm=False)] == ref
    assert tight.engine.num_preemptions > 0
    # Seeded sampling draws on the device and reproduces.
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=2)
    a, b = (llm.generate(prompts[:2], seeded, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(len(o.outputs[0].logprobs) == 8 for o in a)
