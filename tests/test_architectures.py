"""Each registered architecture against transformers: a tiny random model made by transformers,
from its safetensors directory and from a GGUF of the same weights; prompt logprobs and greedy
tokens, with chunked prefill (across window edges), preemption and prefix caching on. Also the
Llama-family shapes (GQA, untied or tied heads, qkv bias, rope_theta) against transformers' own
generate, loading errors, and the embedded model in bfloat16 and its GGUF tokenizer."""
from __future__ import annotations

import json

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.model.kernels import load_kernels
from tests.arch_models import hf_greedy, hf_logprobs, make_model, write_gguf

KINDS = ["llama-llama3", "llama-linear", "llama-dynamic", "llama-yarn", "qwen2", "qwen3", "mistral", "gemma3",
         "phi3", "qwen3-moe", "smollm3", "gpt-oss"]
# llama.cpp has no dynamic rope; its Gemma 3 files cannot hold another attention scale than 1/sqrt(head_dim).
GGUF_KINDS = ["llama-llama3", "llama-linear", "llama-yarn", "qwen2", "qwen3", "mistral", "gemma3-gguf", "phi3",
              "qwen3-moe", "smollm3", "gpt-oss"]
PROMPTS = [[(7 * i + 3) % 300 + 2 for i in range(45)], [(11 * i + 5) % 300 + 2 for i in range(29)],
           [(7 * i + 3) % 300 + 2 for i in range(37)]]  # the third shares the first's first 37 tokens
NEW = 12
TOL = 2e-4


_MADE: dict[str, tuple] = {}


def _tiny(kind: str, tmp_path_factory) -> tuple:
    if kind not in _MADE:
        path = tmp_path_factory.mktemp(kind)
        model = make_model(kind, path)
        refs = [hf_logprobs(model, p) for p in PROMPTS]
        greedy = [hf_greedy(model, p, NEW) for p in PROMPTS]
        _MADE[kind] = (kind, path, model, refs, greedy)
    return _MADE[kind]


@pytest.fixture(params=KINDS)
def tiny(request, tmp_path_factory):
    return _tiny(request.param, tmp_path_factory)


@pytest.fixture(params=GGUF_KINDS)
def tiny_gguf(request, tmp_path_factory):
    return _tiny(request.param, tmp_path_factory)


def max_logprob_diff(llm: LLM, refs: list[torch.Tensor]) -> float:
    """The largest |ferry - transformers| prompt logprob over the prompts."""
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, prompt_logprobs=0)
    worst = 0.0
    for p, ref, out in zip(PROMPTS, refs, llm.generate(PROMPTS, sp, use_tqdm=False)):
        got = torch.tensor([out.prompt_logprobs[j][p[j]] for j in range(1, len(p))])
        worst = max(worst, float((got - ref).abs().max()))
    return worst


def engine(model: str, blocks: int = 26, **kw) -> LLM:
    # A 16-token budget cuts every prompt into chunks (the window is 8); few blocks force preemption.
    return LLM(model=model, quant_activations="exact", max_num_batched_tokens=16, max_num_seqs=3, block_size=4, num_kv_blocks=blocks,
               enable_prefix_caching=True, **kw)


# A model whose every layer has a window gives back the blocks the window passed, so three requests
# fit in the fewest blocks one of them needs to be admitted: it never preempts here (the blocks it
# gives back are checked in test_sliding_window.py).
BLOCKS = {"mistral": 40}  # room for the prefix cache to keep what the window passed
NO_PREEMPTION = {"mistral"}
# The architectures the fused C decode serves (the others decode through torch).
FUSED = {"llama-llama3", "llama-linear", "llama-dynamic", "llama-yarn", "qwen2", "qwen3", "mistral", "gemma3", "phi3",
         "smollm3", "qwen3-moe", "gpt-oss"}


def test_prompt_logprobs_and_greedy_tokens_match_transformers(tiny):
    kind, path, model, refs, greedy = tiny
    llm = engine(str(path), BLOCKS.get(kind, 26))
    if load_kernels() is not None:
        assert (llm.engine.executor.model.fused is not None) == (kind in FUSED)
    diff = max_logprob_diff(llm, refs)
    print(f"{kind} safetensors max |d logprob| {diff:.2e}")
    assert diff < TOL
    assert (llm.engine.num_preemptions > 0) != (kind in NO_PREEMPTION)
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=0)
    for _ in range(2):  # the second time from the prefix cache (the third prompt hits the first's blocks both times)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == greedy
        # The decode steps' logprobs (the fused C decode where the architecture has it) too.
        for p, g, out in zip(PROMPTS, greedy, outs):
            ref = hf_logprobs(model, p + g)[-NEW:]
            got = torch.tensor([out.outputs[0].logprobs[j][g[j]] for j in range(NEW)])
            assert float((got - ref).abs().max()) < TOL
    assert llm.engine.scheduler.kv.num_hit_tokens > 0


def test_speculative_verify_matches_transformers(tiny):
    kind, path, model, refs, greedy = tiny
    llm = engine(str(path), speculative_config=dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                                                    prompt_lookup_max=3))
    prompt = [5, 6, 7, 8, 9, 10, 11] * 5  # longer than the window, and the drafter finds drafts in it
    outs = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, min_tokens=16), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == hf_greedy(model, prompt, 16)
    assert llm.engine.scheduler.num_drafts > 0


def test_the_same_weights_from_a_gguf_match_transformers(tiny_gguf, tmp_path, monkeypatch):
    kind, path, model, refs, greedy = tiny_gguf
    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(model, tmp_path / f"{kind}.gguf")
    for quant in ("gguf", "none"):  # kept as the GGUF's tensors, and converted to a directory
        llm = engine(str(gguf), quantization=quant)
        assert llm.engine.executor.model_config.architecture == model.config.architectures[0]
        diff = max_logprob_diff(llm, refs)
        print(f"{kind} gguf ({quant}) max |d logprob| {diff:.2e}")
        assert diff < TOL


def _prompt_logprobs(llm: LLM) -> list[torch.Tensor]:
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    return [torch.tensor([o.prompt_logprobs[j][p[j]] for j in range(1, len(p))])
            for p, o in zip(PROMPTS, llm.generate(PROMPTS, sp, use_tqdm=False))]


def test_a_quantized_gguf_runs_on_its_blocks(tiny_gguf, tmp_path, monkeypatch):
    """Every architecture's GGUF matrices (experts, Phi-3's fused qkv and gate_up too) stay in their
    Q8_0 blocks, and compute what the same file dequantized computes."""
    kind, path, model, refs, greedy = tiny_gguf
    if load_kernels() is None:
        pytest.skip("no C kernels here: quantized weights are dequantized")
    from ferry.model.quant import QuantWeight
    from tests.arch_models import rounded_model

    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(model, tmp_path / f"{kind}-q8.gguf", quantize="Q8_0")
    kept, plain = engine(str(gguf), quantization="gguf"), engine(str(gguf), quantization="none")
    layer = kept.engine.executor.model.layers[0]
    assert isinstance(layer.mixer.qkv, QuantWeight)
    assert isinstance(layer.mlp.gate_up[0] if hasattr(layer.mlp, "router") else layer.mlp.gate_up, QuantWeight)
    # The reference: transformers with every matrix rounded to Q8_0 and back by the gguf library.
    rounded = rounded_model(model, "Q8_0")
    a, b = _prompt_logprobs(kept), _prompt_logprobs(plain)
    diff = max(float((x - hf_logprobs(rounded, p)).abs().max()) for x, p in zip(a, PROMPTS))
    print(f"{kind} Q8_0 gguf (blocks) max |d logprob| vs transformers on the rounded weights {diff:.2e}")
    assert diff < TOL
    assert max(float((x - y).abs().max()) for x, y in zip(a, b)) < TOL


def test_dummy_weights_for_every_architecture(tmp_path):
    from ferry.model.arch import ARCHITECTURES
    from tests.arch_models import hf_config

    for kind in KINDS:
        cfg = hf_config(kind).to_dict()
        d = tmp_path / kind
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        llm = LLM(model=str(d), load_format="dummy", num_kv_blocks=32)
        assert llm.engine.executor.model_config.architecture in ARCHITECTURES
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):  # real weights: there are none
            LLM(model=str(d))


def test_an_unknown_architecture_is_named_with_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*ferry runs LlamaForCausalLM, .*Qwen3ForCausalLM"):
        LLM(model=str(tmp_path), load_format="dummy")
    # ... and refused before any weights are looked for.
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(model=str(gpt2))


# ---------------------------------------------------------------- Llama-family shapes, transformers' generate
def generate_config(kind: str):
    """GQA and rope_theta 500 in every one; an untied head (llama), a tied one with k biases (qwen2),
    and Mistral without a window."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, rope_theta=500.0, eos_token_id=299, bos_token_id=1)
    if kind == "llama-untied":
        return LlamaConfig(tie_word_embeddings=False, **common)
    if kind == "qwen2-bias":
        return Qwen2Config(tie_word_embeddings=True, **common)
    return MistralConfig(tie_word_embeddings=False, sliding_window=None, **common)


@pytest.mark.parametrize("kind", ["llama-untied", "qwen2-bias", "mistral"])
def test_greedy_tokens_match_transformers_generate(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(generate_config(kind), dtype=torch.float32).eval()
    if kind == "qwen2-bias":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    prompts = [[5, 17, 42, 7, 99], list(range(10, 60))]
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                                 do_sample=False, pad_token_id=0)
            refs.append(gen[0, len(p):].tolist())
    llm = LLM(model=str(tmp_path), max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, min_tokens=16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs


# ---------------------------------------------------------------- the embedded model
def test_bfloat16_runs_on_the_embedded_model():
    llm = LLM(dtype="bfloat16", kv_cache_memory_gb=0.25)
    assert llm.engine.executor.kv_caches[0][0].dtype == torch.bfloat16
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_a_gguf_tokenizer_splits_as_llama_cpp_does(embedded_dir):
    """The embedded GGUF's `tokenizer.ggml.pre` is "smollm": digits split one by one before the
    byte-level expression, as llama.cpp and SmolLM2's own tokenizer.json do. The ids are
    llama-server's /tokenize of the same text (a plain byte-level split gives 198, 198 for "\\n\\n")."""
    from ferry.model.tokenizer import Tokenizer

    tok = Tokenizer(embedded_dir)
    assert tok.encode(" following requirements:\n\n1. Explicit") == [1695, 4292, 42, 1116, 33, 30, 1323, 12962]
    assert tok.encode("In 2024, 12 ferries") == tok.encode("In 2024,") + tok.encode(" 12 ferries")
    assert len(tok.encode("2024")) == 4
