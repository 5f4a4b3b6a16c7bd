"""adaptive_k with a draft model on real (tiny) models: drafting turns off while many requests
decode together and comes back when few are left, and greedy output stays the target's own."""
from __future__ import annotations

import pytest

from ferry import LLM, SamplingParams
from tests.test_draft_model_spec import _save_llama

# Step times where, at the prior acceptance (0.8), a verify pays for up to four requests and not
# for six or more (target rows nearly free up to sixteen, dear past them): the rule's choice is
# tested on its own in test_spec_k.
COST = {"target": [[1, 1.0], [16, 1.2], [64, 19.9]], "draft": [[1, 0.2], [16, 1.5]], "verify": [[1, 0.1], [16, 1.0]]}
PROMPTS = [[(5 * i + 11 * n) % 290 + 2 for i in range(n)] for n in range(3, 19)]  # sixteen
# Four requests run long, twelve end early: the batch shrinks from sixteen to four.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=40 if i < 4 else 8, ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_load")
    target = _save_llama(root / "target", 64, 2)
    _save_llama(root / "near", 64, 2, seed=2, noise=0.3, like=target)
    return str(root / "target"), str(root / "near")


def _run(target: str, spec=None):
    llm = LLM(model=target, dtype="float32", speculative_config=spec)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def test_drafting_turns_off_under_load_and_greedy_output_is_the_targets(models):
    target, near = models
    plain, _ = _run(target)
    spec = {"model": near, "num_speculative_tokens": 3, "adaptive_k": True, "step_cost": COST}
    got, llm = _run(target, spec)
    assert got == plain
    steps = [s for s in llm.engine.step_stats if s.num_prefill_tokens == 0]  # decode steps
    crowded = [s for s in steps if s.num_requests >= 12]
    few = [s for s in steps if s.num_requests <= 4]
    assert len(crowded) >= 5 and len(few) >= 5
    assert sum(s.num_draft_tokens for s in crowded) == 0  # sixteen decoding: no drafts
    assert sum(s.num_draft_tokens for s in few) > 0  # four left: drafting again
    sched = llm.engine.scheduler
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens  # accepted and rejected drafts
    # The same requests with a fixed k draft in every step, crowded or not.
    fixed, llm = _run(target, dict(spec, adaptive_k=False))
    assert fixed == plain
    crowded = [s for s in llm.engine.step_stats if s.num_prefill_tokens == 0 and s.num_requests >= 12]
    assert crowded and all(s.num_draft_tokens > 0 for s in crowded)


def test_a_large_batch_never_runs_the_draft_model(models, monkeypatch):
    """Sixty-four decoding requests with the measured step costs: the rule chooses no drafts in
    every step, and the draft model is never run (no catch-up either), however long they decode."""
    from ferry.executor.draft import DraftModel

    calls = []
    run = DraftModel._run
    monkeypatch.setattr(DraftModel, "_run", lambda self, chunks, views: calls.append(len(chunks)) or run(self, chunks, views))
    target, near = models
    prompts = [[(7 * i + 3 * n) % 290 + 2 for i in range(6)] for n in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(model=target, dtype="float32",
              speculative_config={"model": near, "num_speculative_tokens": 4, "adaptive_k": True})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    assert llm.engine.scheduler.num_draft_tokens == 0
    assert calls == []
