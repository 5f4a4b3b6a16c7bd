"""Gemma 4's assistant drafter (``ferry.executor.gemma4_assistant``) against transformers'
Gemma4AssistantForCausalLM: a tiny random Gemma 4 target (test_gemma4's) and a tiny random
assistant (a sliding and a global layer reading the target's K/V). Its logits and projected states
for the target's states equal transformers' (as its candidate generator calls it), and greedy tokens
with it equal those without it across chunked prefill, batching and preemption."""
from __future__ import annotations

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.executor.gemma4_assistant import Gemma4AssistantHead
from tests.arch_models import hf_greedy, random_model
from tests.test_architectures import NEW, PROMPTS, engine
from tests.test_gemma4 import F, S, _perturb, gemma4_config

TOL = 1e-4
K = 3


def assistant_model(target, path, ordered: bool = False):
    """A random assistant for ``target``: hidden 48, a sliding and a global layer of the target's
    head sizes and K/V heads, norms and layer scalars away from 1."""
    import transformers as tf

    text = gemma4_config(num_hidden_layers=2, layer_types=[S, F], num_kv_shared_layers=2, hidden_size=48,
                         hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, use_double_wide_mlp=False,
                         intermediate_size=80)
    cfg = tf.Gemma4AssistantConfig(text_config=text.to_dict(), backbone_hidden_size=target.config.hidden_size,
                                   use_ordered_embeddings=ordered, num_centroids=16, centroid_intermediate_top_k=4)
    model = tf.Gemma4AssistantForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("layer_scalar"):
                _perturb(name, p)
            else:
                p.normal_(0.0, 0.2)
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(cfg.text_config.vocab_size))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    target_path = tmp_path_factory.mktemp("gemma4_target")
    target = random_model(gemma4_config(), target_path, _perturb, buffers=True)
    assistants = {}
    for ordered in (False, True):
        path = tmp_path_factory.mktemp("gemma4_assistant")
        assistants[ordered] = (path, assistant_model(target, path, ordered))
    return target_path, target, assistants


def _reference_drafts(target, assistant, seq: list[int], q: int, tokens: list[int]) -> list[torch.Tensor]:
    """transformers' assistant logits for drafting after ``seq[:q + 1]`` (the target run over
    ``seq[:q]``), fed ``tokens`` (seq[q], then each draft) as its candidate generator does."""
    with torch.no_grad():
        out = target(torch.tensor([seq[:q]]), output_hidden_states=True, return_shared_kv_states=True)
        hidden = out.hidden_states[-1][:, -1:]
        got = []
        for t in tokens:
            embeds = torch.cat([target.get_input_embeddings()(torch.tensor([[t]])), hidden], -1)
            a = assistant(inputs_embeds=embeds, position_ids=torch.tensor([[q]]), shared_kv_states=out.shared_kv_states,
                          attention_mask=torch.ones(1, q + 1, dtype=torch.long), use_cache=False)
            got.append(a.logits[0, -1])
            hidden = a.last_hidden_state
    return got


@pytest.mark.parametrize("ordered", [False, True], ids=["lm_head", "ordered_embeddings"])
def test_the_assistants_drafts_equal_transformers(pair, monkeypatch, ordered):
    target_path, target, assistants = pair
    path, assistant = assistants[ordered]
    calls: list[tuple[int, int, torch.Tensor]] = []
    step = Gemma4AssistantHead.step

    def record(self, token, hidden, q, ctx):
        logits, h = step(self, token, hidden, q, ctx)
        calls.append((q, token, logits.clone()))
        return logits, h

    monkeypatch.setattr(Gemma4AssistantHead, "step", record)
    prompt = PROMPTS[0][:21]  # longer than the window (8) + 1: the sliding layer's reach shows
    llm = LLM(model=str(target_path), quant_activations="exact", block_size=4,
              speculative_config={"method": "mtp", "model": str(path), "num_speculative_tokens": K})
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    seq = prompt + out[0].outputs[0].token_ids
    assert len(calls) >= 2 * K
    worst = 0.0
    for start in range(0, len(calls) - K + 1, K):
        group = calls[start:start + K]
        q = group[0][0]
        assert all(c[0] == q for c in group) and group[0][1] == seq[q]
        ref = _reference_drafts(target, assistant, seq, q, [c[1] for c in group])
        for (_, _, got), want in zip(group, ref):
            worst = max(worst, float((got - want).abs().max()))
    print(f"gemma4 assistant max |d logit| {worst:.2e} over {len(calls)} draft steps")
    assert worst < TOL


def test_greedy_tokens_with_the_assistant_equal_those_without(pair):
    target_path, target, assistants = pair
    path = str(assistants[False][0])
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    prompts = PROMPTS  # batched, in chunks of the 16-token budget, preempted for want of blocks
    plain = [o.outputs[0].token_ids for o in engine(str(target_path)).generate(prompts, sp, use_tqdm=False)]
    llm = engine(str(target_path), speculative_config={"method": "mtp", "model": path, "num_speculative_tokens": K})
    drafted = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert drafted == plain == [hf_greedy(target, p, NEW) for p in prompts]
    assert llm.engine.scheduler.num_draft_tokens > 0
    assert llm.engine.num_preemptions > 0


def test_accepted_drafts_keep_the_greedy_tokens(pair, monkeypatch):
    """A random assistant's drafts are all rejected; here its logits favour the target's true next
    token at most positions, so verifies accept some drafts, reject others, and the tokens stay."""
    target_path, _, assistants = pair
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    plain = [o.outputs[0].token_ids for o in engine(str(target_path)).generate(PROMPTS, sp, use_tqdm=False)]
    nexts: dict[tuple[int, int], int | None] = {}
    for prompt, out in zip(PROMPTS, plain):
        seq = prompt + out
        for p in range(len(seq) - 1):
            key = (p, seq[p])
            nexts[key] = seq[p + 1] if nexts.get(key, seq[p + 1]) == seq[p + 1] else None  # None: ambiguous
    step, last = Gemma4AssistantHead.step, {"h": None, "j": 0}

    def favoured(self, token, hidden, q, ctx):
        j = last["j"] + 1 if hidden is last["h"] else 0  # the draft's j-th token stands at position q + j
        logits, h = step(self, token, hidden, q, ctx)
        last.update(h=h, j=j)
        want = nexts.get((q + j, token))
        if want is not None and (q + j) % 5:
            logits = logits.clone()
            logits[want] += 1e3
        return logits, h

    monkeypatch.setattr(Gemma4AssistantHead, "step", favoured)
    llm = engine(str(target_path), speculative_config={"method": "mtp", "model": str(assistants[False][0]),
                                                      "num_speculative_tokens": K})
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == plain
    sched = llm.engine.scheduler
    print(f"drafted {sched.num_draft_tokens}, accepted {sched.num_accepted_tokens}")
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens


def test_an_assistant_needs_a_gemma4_target(pair, tmp_path):
    from tests.test_mtp_spec import make_model

    _, _, assistants = pair
    make_model("dense", tmp_path)
    with pytest.raises(ValueError, match="Gemma 4 target"):
        LLM(model=str(tmp_path), dtype="float32",
            speculative_config={"method": "mtp", "model": str(assistants[False][0])})


def test_sampled_requests_draft_from_the_assistants_distribution(pair):
    """At a temperature the assistant draws its drafts and hands their distributions to the verifier."""
    target_path, _, assistants = pair
    llm = engine(str(target_path), speculative_config={"method": "mtp", "model": str(assistants[True][0]),
                                                      "num_speculative_tokens": K})
    sp = SamplingParams(temperature=1.0, max_tokens=NEW, min_tokens=NEW)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [NEW] * len(PROMPTS)
    assert llm.engine.scheduler.num_draft_tokens > 0


def test_a_unified_assistant_is_refused_by_name(pair, tmp_path):
    import json

    target_path, _, _ = pair
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma4UnifiedAssistantForCausalLM"],
                                                      "model_type": "gemma4_unified_assistant"}))
    with pytest.raises(ValueError, match="unified assistant"):
        LLM(model=str(target_path), dtype="float32", speculative_config={"method": "mtp", "model": str(tmp_path)})
