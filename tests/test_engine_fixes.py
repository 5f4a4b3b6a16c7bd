"""Regression tests for engine bugs found by reading: each fails on the code before its fix."""
from __future__ import annotations

import json

import pytest

from ferry import LLM, SamplingParams
from ferry.bench.runner import EngineFactory
from ferry.config import EngineConfig
from tests.test_architectures import generate_config
from tests.test_scheduler import make_engine, run_all


def test_static_batch_frees_its_blocks_when_the_last_unfinished_request_is_aborted():
    engine, _ = make_engine(scheduler="static", max_num_seqs=2, block_size=4)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True), request_id="short")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), request_id="long")
    for _ in range(3):
        engine.step()
    assert engine.scheduler.requests.keys() == {"long"}  # "short" finished, its slot still held
    engine.abort("long")
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished()
    engine.add_request([4, 5], SamplingParams(max_tokens=2, ignore_eos=True), request_id="next")
    run_all(engine)  # a new batch starts
    assert engine.kv.pool.num_used == 0


def test_every_eos_id_stops_a_request():
    engine, ex = make_engine()
    prompt = [3, 4]
    # The fake's token is a function of the tokens so far: find what it will emit, call that an EOS.
    first = (sum(prompt) * 31 + len(prompt)) % ex.vocab_size
    engine.eos_token_ids = (5, first)
    req = engine.add_request(prompt, SamplingParams(max_tokens=10))
    run_all(engine)
    assert req.output_token_ids == [first] and req.status.finish_reason == "stop"


def test_generation_config_eos_ids_are_honoured(tmp_path):
    cfg = generate_config("llama-untied").to_dict()
    cfg["eos_token_id"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    llm = LLM(model=str(tmp_path), load_format="dummy")
    assert set(llm.engine.eos_token_ids) == {2, 7, 9} and llm.engine.eos_token_id == 2


def test_step_stats_stay_bounded_in_a_long_lived_engine():
    from ferry.engine.llm_engine import STEP_STATS_KEPT

    engine, _ = make_engine(num_blocks=200, max_num_batched_tokens=8)
    engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=STEP_STATS_KEPT + 50, ignore_eos=True))
    run_all(engine)
    assert len(engine.step_stats) == STEP_STATS_KEPT


def test_engine_factory_loads_the_model_once_for_configs_left_to_the_model_length(tmp_path):
    cfg = generate_config("llama-untied").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    base = EngineConfig(model=str(tmp_path), load_format="dummy")
    factory = EngineFactory()
    first = factory.engine(base)
    assert base.max_model_len is None  # the caller's config is not changed
    assert first.config.max_model_len == cfg["max_position_embeddings"]
    from dataclasses import replace

    second = factory.engine(replace(base, max_num_batched_tokens=64))
    assert second.executor is first.executor and len(factory._executors) == 1


def test_a_sliding_window_model_serves_its_whole_length_with_the_window_on_every_layer(tmp_path):
    cfg = generate_config("mistral").to_dict()
    cfg.update(sliding_window=64, max_position_embeddings=256, architectures=["MistralForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(tmp_path), load_format="dummy")
    assert llm.config.max_model_len == 256  # the window is attention's, not a limit on the length
    assert llm.engine.executor.model_config.layer_windows == (64, 64)
    # Qwen2 carries a window it does not use unless use_sliding_window is set.
    qwen = generate_config("qwen2-bias").to_dict()
    qwen.update(sliding_window=64, use_sliding_window=False, architectures=["Qwen2ForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    llm = LLM(model=str(tmp_path), load_format="dummy")
    assert llm.config.max_model_len == qwen["max_position_embeddings"]
    assert llm.engine.executor.model_config.layer_windows == (None, None)
