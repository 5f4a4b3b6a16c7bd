"""ferry's greedy tokens equal Hugging Face transformers' greedy generate, token for token."""
from __future__ import annotations

import pytest
import torch

from ferry import SamplingParams


@pytest.fixture(scope="module")
def llm(exact_llm):
    """Exact products: transformers' results are the dequantized model's."""
    return exact_llm


NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_model(embedded_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(embedded_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_model, parity_prompts):
    model = hf_model
    outs = []
    with torch.inference_mode():
        for p in parity_prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def test_greedy_matches_transformers(llm, parity_prompts, hf_greedy):
    assert sorted(len(p) for p in parity_prompts) == [5, 17, 42, 90, 150, 230, 310, 400]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    llm.engine.reset_prefix_cache()  # computed here, as transformers computes them
    outs = llm.generate(parity_prompts, sp, use_tqdm=False)
    for prompt, out, ref in zip(parity_prompts, outs, hf_greedy):
        assert len(ref) == NEW_TOKENS
        assert out.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens diverges"


def test_prompt_logprobs_match_transformers_across_chunks_and_preemption(hf_model, parity_prompts):
    from ferry import LLM

    prompts = parity_prompts[3:6]  # 90, 150 and 230 tokens
    with torch.inference_mode():
        refs = [torch.log_softmax(hf_model(torch.tensor([p])).logits[0].float(), -1) for p in prompts]
    # A small budget cuts every prompt into chunks; a small cache forces preemption (recompute).
    llm = LLM(quant_activations="exact", max_num_batched_tokens=64, num_kv_blocks=30, max_num_seqs=3)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    for p, ref, out in zip(prompts, refs, outs):
        lps = out.prompt_logprobs
        assert len(lps) == len(p) and lps[0] is None
        for j in range(1, len(p)):
            entry = lps[j]
            assert p[j] in entry and len(entry) <= 3
            assert abs(entry[p[j]] - float(ref[j - 1, p[j]])) < 1e-3, j
            best = int(ref[j - 1].argmax())
            assert best in entry and abs(entry[best] - float(ref[j - 1, best])) < 1e-3


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers_hidden_states(hf_model, parity_prompts, pooling):
    """An embedding is transformers' final (normed) hidden state, pooled and L2-normalised, however
    the prompt is chunked, with generating requests in the same steps and the prefix cache on."""
    from ferry import LLM

    prompts = parity_prompts[3:6]  # 90, 150 and 230 tokens
    with torch.inference_mode():
        hidden = [hf_model.model(torch.tensor([p])).last_hidden_state[0].float() for p in prompts]
    refs = [torch.nn.functional.normalize(h[-1] if pooling == "last" else h.mean(0), dim=0) for h in hidden]
    llm = LLM(quant_activations="exact", max_num_batched_tokens=64, enable_prefix_caching=True)
    emb = SamplingParams(pooling=pooling)
    gen = SamplingParams(temperature=0, max_tokens=8)
    for second in (False, True):  # the second time "last" starts past the cached prefix; "mean" never does
        outs = llm.generate(prompts + prompts[:1], [emb] * len(prompts) + [gen], use_tqdm=False)
        for ref, out in zip(refs, outs):
            assert out.finished and out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
            assert float((torch.tensor(out.embedding) - ref).abs().max()) < 1e-4
            assert (out.metrics.num_cached_tokens > 0) == (second and pooling == "last")
        assert len(outs[-1].outputs[0].token_ids) == 8


def test_a_mean_pooled_embedding_survives_preemption(hf_model, parity_prompts):
    from ferry import LLM

    short, long = parity_prompts[3], parity_prompts[5]  # 90 and 230 tokens
    with torch.inference_mode():
        ref = torch.nn.functional.normalize(hf_model.model(torch.tensor([long])).last_hidden_state[0].mean(0), dim=0)
    # Three generating requests grow while the embedding (the latest arrival) prefills in chunks:
    # the cache runs out and the embedding is preempted, then computed again (its rows added once).
    llm = LLM(quant_activations="exact", max_num_batched_tokens=64, num_kv_blocks=24, max_num_seqs=4)
    gen = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outs = llm.generate([short] * 3 + [long], [gen] * 3 + [SamplingParams(pooling="mean")], use_tqdm=False)
    assert outs[-1].metrics.num_preemptions > 0
    assert float((torch.tensor(outs[-1].embedding) - ref).abs().max()) < 1e-4
