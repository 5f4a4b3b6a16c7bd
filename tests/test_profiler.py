"""The step profiler: every part of a step is timed, per step shape, and the parts add up."""
from __future__ import annotations

import pytest

from ferry import LLM, SamplingParams
from ferry.engine.profiler import OVERHEAD_PARTS, StepProfiler, step_shape


def test_step_shapes_bucket_by_powers_of_two():
    assert step_shape(1, 0) == "decode B=1"
    assert step_shape(16, 0) == step_shape(31, 0) == "decode B=16-31"
    assert step_shape(0, 512) == "prefill T=512-1023"
    assert step_shape(3, 509) == "mixed T=512-1023"


def test_parts_add_up_to_the_step():
    t = iter([0.0, 1.0, 3.0, 6.0, 10.0])
    prof = StepProfiler(clock=lambda: next(t))
    prof.start()
    prof.tick("schedule")  # 1 s
    prof.split({"qkv": 0.5, "attention": 1.0}, "layers")  # 2 s: 0.5 + 1.0 + 0.5 left over
    prof.tick("sample")  # 3 s
    prof.tick("schedule")  # 4 s more
    prof.finish("decode B=1")
    s = prof.to_dict()["decode B=1"]
    assert s["steps"] == 1 and s["step_ms"] == pytest.approx(10_000)
    assert {p: v["ms"] for p, v in s["parts"].items()} == pytest.approx(
        {"schedule": 5000, "qkv": 500, "attention": 1000, "layers": 500, "sample": 3000})
    assert s["overhead_share"] == pytest.approx(0.8)
    assert "decode B=1: 1 steps" in prof.table()


def test_engine_profile_names_every_part(llm):
    engine = llm.engine
    prof = StepProfiler()
    engine.attach_profiler(prof)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([[1] * 40, [2] * 60], sp, use_tqdm=False)
    finally:
        engine.attach_profiler(None)
    assert engine.executor.model.profiler is None
    shapes = prof.to_dict()
    assert set(shapes) == {"prefill T=64-127", "decode B=2-3"}
    model_parts = {"embed", "qkv", "attention", "o_proj", "gate_up", "down", "lm_head", "norm"}
    for s in shapes.values():
        assert set(OVERHEAD_PARTS) | model_parts <= set(s["parts"])
        assert sum(v["share"] for v in s["parts"].values()) == pytest.approx(1.0)
    assert shapes["decode B=2-3"]["steps"] == 3
