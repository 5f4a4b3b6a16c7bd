"""Bad input gives a clear error naming the problem, and the engine keeps serving the others."""
from __future__ import annotations

import pytest

from ferry import LLM, SamplingParams


def test_bad_requests_are_refused_and_others_still_served(llm):
    engine = llm.engine
    good = engine.add_request("The capital of France is", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], SamplingParams())
    too_long = [100] * (llm.config.max_model_len + 1)
    with pytest.raises(ValueError, match=rf"prompt \({len(too_long)} tokens\).*max_model_len \({llm.config.max_model_len}\)"):
        engine.add_request(too_long, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 49152\)"):
        engine.add_request([5, 49152], SamplingParams())
    with pytest.raises(KeyError, match="no-such-id"):
        engine.abort("no-such-id")
    while engine.has_unfinished():
        engine.step()
    assert good.status.finish_reason == "length" and good.num_output_tokens == 5
    assert engine.kv.pool.num_free == engine.kv.num_blocks


@pytest.mark.parametrize("field,value,allowed", [
    ("max_tokens", 0, ">= 1"), ("top_p", 0.0, r"in \(0, 1\]"), ("top_p", 1.5, r"in \(0, 1\]"),
    ("temperature", -1.0, ">= 0"), ("top_k", -5, ">= 1"), ("min_p", 2.0, r"in \[0, 1\]"),
    ("logprobs", 50, r"in \[0, 20\]"), ("n", 0, ">= 1"), ("presence_penalty", 3.0, r"\[-2, 2\]"),
    ("repetition_penalty", 0.0, "> 0"), ("min_tokens", -1, ">= 0"),
])
def test_invalid_sampling_values_name_the_field(field, value, allowed):
    with pytest.raises(ValueError, match=rf"{field} must be .*{allowed}"):
        SamplingParams(**{field: value})


def test_a_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine prompt", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(model=str(tmp_path / "empty"))


def test_unknown_engine_setting_is_named():
    with pytest.raises(TypeError, match="max_num_bached_tokens"):
        LLM(max_num_bached_tokens=64)
    with pytest.raises(ValueError, match="scheduler must be"):
        LLM(scheduler="fifo")
