"""Speculative decoding with a draft model: configuration, the vocabulary check, greedy outputs equal
to the target's (batched, chunked, preempted), the draft's KV kept consistent (its proposals are its
own greedy continuation of the true tokens), and rejection sampling's output distribution."""
from __future__ import annotations

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.config import EngineConfig
from ferry.executor.sampler import rejection_sample

K = 3


def _save_llama(path, hidden: int, layers: int, vocab: int = 300, seed: int = 0, noise: float = 0.0,
                like=None) -> None:
    """A tiny random Llama; ``like``: a copy of that model with ``noise`` added to its weights (a draft
    that agrees with it often, not always)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=vocab - 1, bos_token_id=1)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        if like is not None:
            model.load_state_dict(like.state_dict())
            for w in model.parameters():
                w.add_(noise * w.std() * torch.randn_like(w))
        else:
            model.lm_head.weight.mul_(40.0)  # peaked logits: no near-ties between batchings
    model.save_pretrained(str(path), safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_spec")
    target = _save_llama(root / "target", 64, 2)
    _save_llama(root / "small", 32, 1, seed=1)
    _save_llama(root / "near", 64, 2, seed=2, noise=0.6, like=target)
    _save_llama(root / "other_vocab", 32, 1, vocab=301)
    return {name: str(root / name) for name in ("target", "small", "near", "other_vocab")}


PROMPTS = [[(7 * i + 3 * n) % 290 + 2 for i in range(n)] for n in (3, 17, 40, 77)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _generate(model: str, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=model, dtype="float32", **kw)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.fixture(scope="module")
def plain(models):
    return _generate(models["target"])[0]


def test_draft_model_is_configured_as_vllm_spells_it():
    spec = EngineConfig(speculative_config='{"model": "DRAFT", "num_speculative_tokens": 5}').speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "DRAFT", 5)
    assert EngineConfig(speculative_config={"method": "ngram"}).speculative_config.method == "ngram"
    for bad, word in [({"method": "draft_model"}, "model"), ({"method": "ngram", "model": "D"}, "model"),
                      ({"method": "eagle"}, "method")]:
        with pytest.raises(ValueError, match=word):
            EngineConfig(speculative_config=bad)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(speculative_config={"model": "D"}, tensor_parallel_size=2)


def test_a_draft_with_another_vocabulary_is_refused(models):
    with pytest.raises(ValueError, match="vocabulary of 301 tokens, the target 300"):
        LLM(model=models["target"], dtype="float32", speculative_config={"model": models["other_vocab"]})


SETTINGS = {"batched": {}, "chunked": {"max_num_batched_tokens": 8},
            "preempted": {"num_kv_blocks": 40, "block_size": 4, "max_model_len": 120}}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("draft", ["small", "target"])
def test_greedy_output_with_a_draft_model_is_the_target_output(models, plain, draft, setting):
    spec = {"model": models[draft], "num_speculative_tokens": K}
    got, llm = _generate(models["target"], speculative_config=spec, **SETTINGS[setting])
    assert got == plain
    s = llm.engine.scheduler
    assert s.num_draft_tokens > 0
    if draft == "target":  # the draft is the target: every draft is accepted, so its KV was right
        assert s.num_accepted_tokens == s.num_draft_tokens
    if setting == "preempted":
        assert s.num_preemptions > 0


@pytest.mark.parametrize("setting", ["chunked", "preempted"])
def test_draft_proposals_are_the_draft_models_own_continuation(models, plain, setting):
    """Rejections, preemption and chunked prefill leave the draft's KV as if it had decoded the
    true tokens alone: each proposal equals the draft model's own greedy continuation."""
    spec = {"model": models["near"], "num_speculative_tokens": K}
    llm = LLM(model=models["target"], dtype="float32", speculative_config=spec, **SETTINGS[setting])
    draft, states = llm.engine.executor.draft, llm.engine.executor.states
    seen: list[tuple[list[int], list[int]]] = []
    propose = draft.propose

    def recording(out, st):
        dists = propose(out, st)
        seen.extend((list(st[c.request_id].all_token_ids), list(c.spec_token_ids))
                    for c in out.chunks if c.spec_token_ids)
        return dists

    draft.propose = recording
    got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == plain
    s = llm.engine.scheduler
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # some accepted, some rejected
    assert states is llm.engine.executor.states and len(seen) > 20
    alone = LLM(model=models["near"], dtype="float32")
    want = alone.generate([p for p, _ in seen], [SamplingParams(temperature=0.0, max_tokens=len(d), ignore_eos=True)
                                                 for _, d in seen], use_tqdm=False)
    assert [d for _, d in seen] == [list(o.outputs[0].token_ids) for o in want]


def test_sampled_requests_are_verified_by_rejection_sampling(models):
    """With the target as its own draft (q == p) a sampled request accepts nearly every draft."""
    spec = {"model": models["target"], "num_speculative_tokens": K}
    llm = LLM(model=models["target"], dtype="float32", speculative_config=spec)
    sp = SamplingParams(temperature=0.8, top_k=50, max_tokens=30, ignore_eos=True, seed=3)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    s = llm.engine.scheduler
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens >= 0.9 * s.num_draft_tokens


# ------------------------------------------------------------------ the sampler function
CHI2_DF4_P001 = 18.467  # chi-square critical value, 4 degrees of freedom, p = 0.001


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_gives_the_target_distribution():
    """Drafts drawn from q, verified against p: the first output token is distributed as p_0, and
    the token after an accepted draft as p_1 (chi-square over many independent draws)."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.05, 0.10, 0.20, 0.25, 0.40], [0.30, 0.05, 0.05, 0.30, 0.30],
                      [0.20, 0.20, 0.20, 0.20, 0.20]])
    q = torch.tensor([[0.40, 0.25, 0.20, 0.10, 0.05], [0.10, 0.50, 0.10, 0.20, 0.10]])
    first, second = torch.zeros(5), torch.zeros(5)
    n = 20000
    for _ in range(n):
        drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
        out = rejection_sample(p, q, drafts, g)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert _chi2(first, p[0]) < CHI2_DF4_P001
    assert second.sum() > 0.3 * n and _chi2(second, p[1]) < CHI2_DF4_P001


def test_serve_with_a_draft_model_reports_drafts_in_metrics():
    """``ferry serve --speculative-config '{"model": ...}'``: the embedded model drafting for itself."""
    import json

    import openai

    from ferry.model.gguf_convert import embedded_gguf_path
    from tests.test_server import MODEL, metric, server, wait_idle

    spec = json.dumps({"model": str(embedded_gguf_path()), "num_speculative_tokens": 4})
    with server("--speculative-config", spec) as proc:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none")
        out = client.completions.create(model=MODEL, prompt="The ferry crossed the river", max_tokens=24,
                                        temperature=0)
        assert out.usage.completion_tokens == 24
        wait_idle(proc.url)
        drafts = metric(proc.url, "ferry:spec_decode_num_draft_tokens_total")
        accepted = metric(proc.url, "ferry:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= drafts and metric(proc.url, "ferry:spec_decode_num_drafts_total") > 0
        assert metric(proc.url, "ferry:spec_decode_acceptance_rate") == pytest.approx(accepted / drafts)
