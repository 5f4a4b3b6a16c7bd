"""Sampling features on the embedded model."""
from __future__ import annotations

import torch

from ferry import SamplingParams

PROMPT = "Once upon a time, in a small village by the sea,"


def test_seed_reproduces_and_different_seeds_differ(llm):
    sp = lambda seed: SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=seed, ignore_eos=True)
    a, b, c = llm.generate([PROMPT, PROMPT, PROMPT], [sp(1), sp(1), sp(2)], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].token_ids != c.outputs[0].token_ids
    alone = llm.generate(PROMPT, sp(1), use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == a.outputs[0].token_ids


def test_top_k_1_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    topk = llm.generate(PROMPT, SamplingParams(temperature=0.8, top_k=1, max_tokens=16, seed=3), use_tqdm=False)[0]
    assert topk.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_min_p_near_1_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    minp = llm.generate(PROMPT, SamplingParams(temperature=1.0, min_p=0.999, max_tokens=12, seed=5), use_tqdm=False)[0]
    assert minp.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_stop_string_truncates_and_reports(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    words = greedy.text.split()
    stop = words[3]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and greedy.text.startswith(out.text)


def test_stop_token_ids_and_max_tokens(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    ids = greedy.outputs[0].token_ids
    assert greedy.outputs[0].finish_reason == "length" and len(ids) == 20
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids[5]]),
                       use_tqdm=False)[0].outputs[0]
    first = ids.index(ids[5])
    assert out.token_ids == ids[:first + 1] and out.finish_reason == "stop" and out.stop_reason == ids[5]


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_off(llm):
    conv = [{"role": "user", "content": "Say only the word yes."}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 64
    eos = llm.engine.eos_token_id
    assert out.token_ids[-1] == eos
    longer = llm.chat(conv, SamplingParams(temperature=0, max_tokens=64, min_tokens=len(out.token_ids) + 3),
                      use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= len(out.token_ids) + 3
    assert eos not in longer.token_ids[:len(out.token_ids) + 2]


def test_logprobs_top_n(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and len(entry) == 3  # greedy: the sampled token is the top one
        assert max(entry, key=entry.get) == tok
        assert all(v <= 0 for v in entry.values())


def test_repetition_penalty_reduces_repeats(llm):
    prompt = "one two one two one two one two one two"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    pen = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=2.0,
                                              frequency_penalty=1.0), use_tqdm=False)[0]
    seen = set(llm.tokenizer.encode(prompt, add_special_tokens=False))
    count = lambda o: sum(t in seen for t in o.outputs[0].token_ids)
    assert count(pen) < count(plain)


def test_n_completions_in_one_output(llm):
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=11, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_outputs_keep_input_order_and_timings(llm):
    prompts = ["A" * 3, "Tell me a long story about dragons and castles.", "Hi"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert len(m.token_times) == 5 and m.tpot is not None
        assert 0 < m.ttft <= m.e2e and m.tpot <= m.e2e - m.ttft


def test_greedy_tokens_are_torchs_argmax_ties_nan_and_inf_included():
    """The CPU's numpy argmax picks what torch's does: the first of equal maxima, a NaN over any
    number, the first -inf of a row of them; on any stride."""
    from ferry.executor.sampler import greedy_tokens

    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (64, 97), generator=g).float()  # many equal maxima per row
    x[3, 50] = float("nan")
    x[4, 7] = x[4, 90] = float("nan")
    x[5] = float("-inf")
    x[6, 10:] = float("inf")
    x[7] = torch.randn(97, generator=g)
    for rows in (x, x[:, ::2], x[1:2]):
        assert greedy_tokens(rows) == rows.argmax(dim=-1).tolist()
