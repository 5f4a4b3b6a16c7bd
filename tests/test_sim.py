"""The simulator: cost model maths, calibration, determinism, and the 32-request static-waste example."""
from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.bench.runner import run_workload
from ferry.bench.batching_report import static_waste_lengths
from ferry.bench.workload import WorkloadRequest, synthetic_workload, with_request_rate
from ferry.config import EngineConfig
from ferry.model.config import ModelConfig
from ferry.sim.calibrate import Sample, calibration_shapes, fit_profile
from ferry.sim.cost_model import CostModel
from ferry.sim.engine import SimEngineFactory
from ferry.sim.hardware import Hardware, load_hardware
from ferry.sim.models import load_model_config
from ferry.sim.tune import pareto_frontier

TINY = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8,
                                  intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, tie_word_embeddings=True))
# 1000 FLOP/s for linear layers, 500 for attention, 100 B/s, 1 byte per value, 1 ms + 0.5 ms per request.
ROUND = Hardware("round", peak_tflops=1e-9, mem_bandwidth_gbs=1e-7, memory_gb=1, dtype_bytes=1,
                 flops_efficiency=1.0, attn_flops_efficiency=0.5, bw_efficiency=1.0,
                 step_overhead_ms=1.0, per_request_overhead_ms=0.5)


def test_cost_model_by_hand():
    cost = CostModel(TINY, ROUND)
    # linear params: q 8x8 + k,v 8x4 each + o 8x8 + gate/up/down 3 x 8x16 = 576; lm head 8 x 10 = 80
    assert cost.linear_params == 576 and cost.head_params == 80
    # decode: 1 token at position 9. linear max(1152/1000, 576/100); attention max(4*8*1*10/500, 2*4*10/100);
    # head max(160/1000, 80/100); overhead 1 + 0.5 ms
    assert cost.step_time([(1, 9)], 1) == pytest.approx(5.76 + 0.8 + 0.8 + 0.0015)
    # prefill of 100: linear 2*576*100/1000; attention 4*8*100*50.5/500 (compute-bound); head 0.8
    assert cost.step_time([(100, 0)], 1) == pytest.approx(115.2 + 323.2 + 0.8 + 0.0015)
    # mixed: both at once, 101 tokens, 2 sampling rows, 2 requests
    assert cost.step_time([(1, 9), (100, 0)], 2) == pytest.approx(116.352 + 323.84 + 0.8 + 0.002)
    assert cost.step_time([(100, 0)], 0) == pytest.approx(115.2 + 323.2 + 0.0015)  # no sampling, no head
    # an engine that copies a prefill chunk's cached context: K and V, 1 layer x 4 values x 1 byte = 8 B a
    # token, at 80 B/s: 0.1 s a token of context
    gather = CostModel(TINY, dataclasses.replace(ROUND, context_gather_gbs=8e-8))
    assert gather.step_time([(100, 30)], 1) - cost.step_time([(100, 30)], 1) == pytest.approx(3.0)
    assert gather.step_time([(1, 30)], 1) == cost.step_time([(1, 30)], 1)  # decodes read the cache in place


chunk = st.tuples(st.integers(1, 512), st.integers(0, 4096))


@settings(max_examples=200, deadline=None)
@given(st.lists(chunk, min_size=1, max_size=20), chunk, st.sampled_from(["h100-sxm", "l4", "a100-80gb"]))
def test_a_larger_step_never_takes_less_time(chunks, extra, hw):
    cost = CostModel(load_model_config("llama-3.1-8b"), load_hardware(hw))
    base = cost.step_time(chunks, len(chunks))
    assert cost.step_time(chunks + [extra], len(chunks) + 1) >= base  # one more request
    grown = [(chunks[0][0] + 1, chunks[0][1])] + chunks[1:]
    assert cost.step_time(grown, len(chunks)) >= base  # one more token
    longer = [(chunks[0][0], chunks[0][1] + 100)] + chunks[1:]
    assert cost.step_time(longer, len(chunks)) >= base  # a longer context


def test_tensor_parallel_splits_work_and_adds_communication():
    m, hw = load_model_config("llama-3.1-70b"), load_hardware("h100-sxm")
    one, four = CostModel(m, hw, 1), CostModel(m, hw, 4)
    assert four.step_time([(2048, 0)], 1) < one.step_time([(2048, 0)], 1) / 3
    no_comm = four.time(four.terms([(2048, 0)], 1)) - 2 * m.num_layers * (
        hw.allreduce_latency_us * 1e-6 + 1.5 * 2048 * m.hidden_size * 2 / (hw.interconnect_gbs * 1e9))
    assert no_comm == pytest.approx(one.step_time([(2048, 0)], 1) / 4, rel=0.05)
    CostModel(m, hw, 3)  # 8 KV heads go 3 + 3 + 2, as the real engine splits them
    with pytest.raises(ValueError, match="does not split"):
        CostModel(m, hw, 12)  # fewer KV heads than ranks, and 12 is not a multiple of 8
    with pytest.raises(ValueError, match="no interconnect_gbs"):  # at once, not at the first step
        CostModel(m, dataclasses.replace(hw, interconnect_gbs=0.0), 2)


def test_kv_cache_is_sized_from_memory_minus_weights():
    f = SimEngineFactory(load_model_config("llama-3.1-8b"), load_hardware("h100-sxm"), gpu_memory_utilization=0.9)
    weights = f.cost.weight_bytes_total
    assert weights == pytest.approx(16.06e9, rel=0.01)  # 8.03 B parameters in bf16
    per_block = 2 * 32 * 8 * 128 * 2 * 16
    assert f.num_kv_blocks(EngineConfig()) == int((80e9 * 0.9 - weights) // per_block)
    with pytest.raises(ValueError, match="leave no room for a KV cache"):
        SimEngineFactory(load_model_config("llama-3.1-70b"), load_hardware("l4")).num_kv_blocks(EngineConfig())
    # 70B over 4 GPUs: 70.55 B parameters in bf16, 80 layers x 8 KV heads x 128 x 2 bytes, K and V, 16 a block.
    f70 = SimEngineFactory(load_model_config("llama-3.1-70b"), load_hardware("h100-sxm"), tp=4)
    assert f70.cost.weight_bytes_total == pytest.approx(141.1e9, rel=0.01)
    per_block = 2 * 80 * 8 * 128 * 2 * 16
    assert f70.num_kv_blocks(EngineConfig()) == int((4 * 80e9 * 0.9 - f70.cost.weight_bytes_total) // per_block)
    assert 27_500 < f70.num_kv_blocks(EngineConfig()) < 28_500


def test_simulation_is_deterministic_and_preempts_when_memory_is_short():
    reqs = with_request_rate(synthetic_workload(300, 400, 200, "lognormal", "lognormal", seed=3, vocab_size=1000),
                             50.0, seed=3)
    f = SimEngineFactory(load_model_config("llama-3.1-8b"), load_hardware("l4"))  # 24 GB: a small cache
    a = run_workload(f.engine(EngineConfig(max_num_seqs=256)), reqs, progress=False).metrics.to_dict()
    b = run_workload(f.engine(EngineConfig(max_num_seqs=256)), reqs, progress=False).metrics.to_dict()
    assert a == b
    assert a["completed"] == 300 and a["num_preemptions"] > 0


def test_static_waste_example_wastes_95_percent_and_continuous_wastes_nothing():
    lens = static_waste_lengths(32, 100, 2000)
    rng = random.Random(0)
    reqs = [WorkloadRequest([rng.randrange(100, 1000) for _ in range(16)], n) for n in lens]
    f = SimEngineFactory(load_model_config("llama-3.1-8b"), load_hardware("h100-sxm"))
    static = run_workload(f.engine(EngineConfig(scheduler="static", max_num_seqs=32)), reqs, progress=False).metrics
    cont = run_workload(f.engine(EngineConfig()), reqs, progress=False).metrics
    # 32 requests of mean 100 (3200 tokens) held for 2000 steps each: 1 - 3200 / 64000 = 95% of the slots idle.
    assert (len(lens), sum(lens), max(lens)) == (32, 3200, 2000)
    assert 1 - static.generation_slot_utilization == pytest.approx(0.95)
    assert 1 - cont.generation_slot_utilization == 0.0
    assert cont.duration < static.duration


@pytest.mark.parametrize("noise,overlap,outliers", [(0.0, 1.0, False), (0.02, 1.0, False), (0.0, 0.0, False),
                                                    (0.02, 0.0, False), (0.02, 0.0, True)])
def test_calibration_recovers_known_coefficients(noise, overlap, outliers):
    """From synthetic step times: exactly without noise, within 10% with 2% noise, and still within
    10% when one step in eight is slowed 1.5-3x by another tenant (the Huber fit ignores them)."""
    model = load_model_config("smollm2-135m")
    true = Hardware("cpu", peak_tflops=0.15, mem_bandwidth_gbs=20, memory_gb=2, dtype_bytes=4, flops_efficiency=1.0,
                    attn_flops_efficiency=0.4, bw_efficiency=1.0, step_overhead_ms=3.0, per_request_overhead_ms=0.1,
                    overlap=overlap, context_gather_gbs=0.5, per_prefill_chunk_ms=5.0)
    cost = CostModel(model, true)
    rng = random.Random(1)
    shapes = calibration_shapes(40000) * (3 if outliers else 1)
    samples = [Sample(s, cost.step_time(s, len(s)) * (1 + rng.gauss(0, noise))
                      * (rng.uniform(1.5, 3) if outliers and rng.random() < 0.125 else 1)) for s in shapes]
    hw, err = fit_profile(model, samples, "fit", 4, memory_gb=2)
    rel = 1e-6 if noise == 0 else 0.1
    assert err <= max(1e-9, 2 * noise)
    assert hw.overlap == overlap
    assert hw.flops == pytest.approx(true.flops, rel=rel)
    assert hw.bandwidth == pytest.approx(true.bandwidth, rel=rel)
    assert hw.attn_flops == pytest.approx(true.attn_flops, rel=rel)
    assert hw.context_gather_gbs == pytest.approx(0.5, rel=rel if noise == 0 else 0.25)
    # The fixed costs are small next to 2% noise on 30-1000 ms steps: recovered to about a millisecond.
    assert hw.step_overhead_ms == pytest.approx(3.0, rel=rel, abs=1e-6 if noise == 0 else 1.5)
    assert hw.per_request_overhead_ms == pytest.approx(0.1, rel=rel, abs=1e-6 if noise == 0 else 0.1)
    assert hw.per_prefill_chunk_ms == pytest.approx(5.0, rel=rel, abs=1e-6 if noise == 0 else 2.5)


def test_pareto_frontier():
    pts = [{"label": "a", "output_throughput": 10, "p99_ttft_ms": 1, "p99_tpot_ms": 1},
           {"label": "b", "output_throughput": 20, "p99_ttft_ms": 5, "p99_tpot_ms": 5},
           {"label": "c", "output_throughput": 9, "p99_ttft_ms": 2, "p99_tpot_ms": 2},  # worse than a on all
           {"label": "d", "output_throughput": 15, "p99_ttft_ms": 9, "p99_tpot_ms": 0.5}]
    assert [p["label"] for p in pareto_frontier(pts)] == ["b", "d", "a"]


def test_presets_and_errors():
    # The published layer counts, and the datasheets' HBM bandwidths at the default 80% efficiency.
    layers = {"llama-3.1-8b": 32, "llama-3.1-70b": 80, "qwen2.5-7b": 28, "smollm2-135m": 30}
    assert {name: load_model_config(name).num_layers for name in layers} == layers
    gbs = {"a100-80gb": 2039, "h100-sxm": 3350, "h200": 4800, "l4": 300}
    for name, datasheet in gbs.items():
        assert load_hardware(name).bandwidth == pytest.approx(0.8 * datasheet * 1e9), name
    with pytest.raises(ValueError, match="unknown model 'gpt-9'"):
        load_model_config("gpt-9")
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        load_hardware("tpu")


def ferry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ferry.cli", *args], capture_output=True, text=True, timeout=600)


def test_simulate_command_never_imports_torch(tmp_path):
    code = ("import sys; from ferry.cli import main; "
            f"rc = main(['simulate', '--model', 'qwen2.5-7b', '--hardware', 'a100-80gb', '--num-prompts', '50', "
            f"'--request-rate', '5', '--no-progress', '--output-json', '{tmp_path}/s.json', '--plot', '{tmp_path}']); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    d = json.loads((tmp_path / "s.json").read_text())
    assert d["completed"] == 50 and d["request_rate"] == 5.0
    assert (tmp_path / "simulate-timeline.png").stat().st_size > 1000


def test_profile_file_round_trip_and_bad_profile(tmp_path):
    ROUND.save(tmp_path / "p.json")
    assert load_hardware(str(tmp_path / "p.json")) == ROUND
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x", "peak_tflops": 1, "speed": 3}))
    with pytest.raises(ValueError, match="unknown hardware field"):
        load_hardware(str(tmp_path / "bad.json"))


def test_tune_picks_the_best_configuration_within_the_slo(tmp_path):
    p = ferry("tune", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--num-prompts", "200", "--input-len",
              "1000", "--output-len", "100", "--input-dist", "lognormal", "--request-rate", "8",
              "--slo", "tpot_p99=12", "--max-num-batched-tokens", "256,1024,4096", "--max-num-seqs", "64,256",
              "--output-json", str(tmp_path / "t.json"), "--plot", str(tmp_path))
    assert p.returncode == 0, p.stderr
    d = json.loads((tmp_path / "t.json").read_text())
    ok = [pt for pt in d["points"] if pt["p99_tpot_ms"] <= 12]
    assert d["best"]["label"] == max(ok, key=lambda pt: pt["output_throughput"])["label"]
    assert len(d["points"]) + len(d["skipped"]) == 12
    assert (tmp_path / "tune.png").stat().st_size > 1000


def test_simulate_batching_report(tmp_path):
    p = ferry("simulate", "batching-report", "--quick", "--model", "llama-3.1-8b", "--hardware", "h100-sxm",
              "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# ferry simulate: the batching experiments, llama-3.1-8b on 1 x h100-sxm (simulated)")
    assert "## (d) FCFS vs priority" in text


def test_measure_steps_times_real_steps_on_the_model_executor(llm):
    """Calibration drives the executor with plain scheduler outputs of its own making."""
    from ferry.sim.calibrate import measure_steps

    ex = llm.engine.executor
    shapes = [((1, 40), (1, 90)), ((24, 0),), ((16, 32), (1, 20))]
    try:
        samples = measure_steps(ex, shapes, reps=2, passes=1, progress=False)
    finally:
        llm.engine.reset_prefix_cache()  # calibration wrote into blocks the engine may have cached
    assert [s.shape for s in samples] == shapes and all(s.seconds > 0 for s in samples)
    assert not [rid for rid in ex.states.requests if rid.startswith("cal-")]  # their states were dropped
