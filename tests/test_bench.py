"""Workloads, the run loop, sweeps, plots and the batching report (fake executor on a manual clock),
plus the bench commands on the embedded model."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from statistics import fmean

import pytest

from ferry.bench import plots
from ferry.bench.runner import run_workload
from ferry.bench.batching_report import QUICK, run_batching_report, static_waste_lengths
from ferry.bench.sweep import best_under_slo, grid_configs, parse_list, parse_slo, run_sweep, slo_field
from ferry.bench.workload import (WorkloadRequest, load_workload, poisson_arrivals, sample_lengths, save_workload,
                                  synthetic_workload, with_request_rate)
from ferry.config import EngineConfig
from tests.fakes import FakeEngineFactory


# ---------------------------------------------------------------- workloads and arrivals
def test_poisson_arrivals_are_seeded_and_have_the_right_mean():
    a = poisson_arrivals(20000, rate=4.0, seed=7)
    assert a == poisson_arrivals(20000, rate=4.0, seed=7)
    assert a != poisson_arrivals(20000, rate=4.0, seed=8)
    gaps = [y - x for x, y in zip([0.0] + a, a)]
    assert all(g >= 0 for g in gaps)
    assert fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # exponential gaps: the standard deviation equals the mean
    assert (fmean([g * g for g in gaps]) - fmean(gaps) ** 2) ** 0.5 == pytest.approx(0.25, rel=0.05)
    assert poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request rate"):
        poisson_arrivals(3, 0)


def test_length_distributions():
    import random

    rng = random.Random(0)
    assert sample_lengths(5, 7, "fixed", rng) == [7] * 5
    u = sample_lengths(2000, 100, "uniform", rng, range_ratio=0.2)
    assert min(u) >= 80 and max(u) <= 120
    ln = sample_lengths(20000, 100, "lognormal", rng, sigma=1.0)
    assert fmean(ln) == pytest.approx(100, rel=0.05) and max(ln) > 500  # a long tail
    with pytest.raises(ValueError, match="length distribution"):
        sample_lengths(1, 5, "zipf", rng)


def test_workload_file_round_trip_keeps_arrival_and_priority(tmp_path):
    reqs = [WorkloadRequest([1, 2, 3], 4, arrival_time=0.5, priority=2), WorkloadRequest([5], 1)]
    save_workload(reqs, tmp_path / "w.json")
    assert load_workload(tmp_path / "w.json") == reqs
    (tmp_path / "bad.json").write_text(json.dumps({"requests": [{"max_tokens": 3}]}))
    with pytest.raises(ValueError, match="request 0 needs prompt_token_ids"):
        load_workload(tmp_path / "bad.json")


def test_static_waste_lengths():
    lens = static_waste_lengths(32, 100, 2000)
    assert len(lens) == 32 and max(lens) == 2000 and sum(lens) == 3200 and min(lens) >= 1


# ---------------------------------------------------------------- the run loop
def test_online_run_honours_arrival_times_and_priorities():
    f = FakeEngineFactory()
    reqs = with_request_rate(synthetic_workload(12, 20, 5, seed=1, vocab_size=1000), rate=2.0, seed=3)
    run = run_workload(f.engine(EngineConfig()), reqs, progress=False)
    assert run.metrics.completed == 12
    for r, o in zip(reqs, run.outputs):
        assert o.metrics.arrival_time == pytest.approx(run.start + r.arrival_time)
        assert o.metrics.first_scheduled_time >= o.metrics.arrival_time
        assert len(o.outputs[0].token_ids) == r.max_tokens
    # The engine idles between sparse arrivals: the run lasts at least until the last arrival.
    assert run.metrics.duration >= max(r.arrival_time for r in reqs)


def test_offline_static_run_counts_idle_slots():
    f = FakeEngineFactory()
    reqs = [WorkloadRequest([1] * 8, n) for n in (2, 10, 4, 6)]
    run = run_workload(f.engine(EngineConfig(scheduler="static", max_num_seqs=4)), reqs, progress=False)
    assert run.metrics.num_padding_tokens == sum(10 - n for n in (2, 10, 4, 6))
    assert run.metrics.generation_slot_utilization == pytest.approx(22 / 40)
    grid = plots.timeline_grid(run)
    idle = plots._CODE["idle slot (finished, slot held)"]
    assert [int((row == idle).sum()) for row in grid] == [8, 0, 6, 4]


# ---------------------------------------------------------------- sweeps and the SLO rule
def test_slo_parsing_and_best_pick():
    assert parse_slo("ttft_p99=2000,tpot_p99=100") == {"ttft_p99": 2000.0, "tpot_p99": 100.0}
    assert slo_field("itl_median") == "median_itl_ms"
    with pytest.raises(ValueError, match="METRIC_STAT"):
        parse_slo("latency=3")
    with pytest.raises(ValueError, match="KEY=MILLISECONDS"):
        parse_slo("ttft_p99")
    with pytest.raises(ValueError, match="--max-num-seqs"):
        parse_list("max_num_seqs", "4,x", int)
    pts = [{"output_throughput": 10, "p99_ttft_ms": 50, "p99_tpot_ms": 5},
           {"output_throughput": 30, "p99_ttft_ms": 500, "p99_tpot_ms": 5},
           {"output_throughput": 20, "p99_ttft_ms": 90, "p99_tpot_ms": 9}]
    assert best_under_slo(pts, {"ttft_p99": 100, "tpot_p99": 10}) is pts[2]
    assert best_under_slo(pts, {"ttft_p99": 10}) is None


def test_grid_runs_static_once_per_remaining_setting():
    grid = {"scheduler": ["continuous", "static"], "max_num_batched_tokens": [64, 128]}
    configs = grid_configs(EngineConfig(), grid)
    assert [(c.scheduler, c.max_num_batched_tokens) for c in configs] == \
        [("continuous", 64), ("continuous", 128), ("static", 512)]


def test_sweep_runs_every_point_and_skips_invalid_ones_with_the_reason():
    f = FakeEngineFactory()
    reqs = synthetic_workload(6, 30, 4, seed=2, vocab_size=1000)
    base = EngineConfig(max_model_len=256)
    runs, skipped = run_sweep(base, reqs, {"max_num_batched_tokens": [16, 256],
                                           "enable_chunked_prefill": [True, False]}, [None, 5.0],
                              factory=f, progress=False)
    assert len(runs) == 6 and all(r.metrics.completed == 6 for r in runs)
    assert len(skipped) == 1 and "max_num_batched_tokens (16) must be >= max_model_len (256)" in skipped[0]
    assert {r.extra["request_rate"] for r in runs} == {None, 5.0}


# ---------------------------------------------------------------- plots and the report
@pytest.fixture(scope="module")
def small_runs():
    f = FakeEngineFactory(num_kv_blocks=20)
    reqs = with_request_rate(synthetic_workload(10, 60, 20, "uniform", "lognormal", seed=1, vocab_size=1000), 20.0)
    return [run_workload(f.engine(EngineConfig(scheduler=s, max_num_seqs=8 if s == "continuous" else 3,
                                               max_num_batched_tokens=64)), reqs, label=s, progress=False)
            for s in ("continuous", "static")]


def _png(path) -> bool:
    return path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_functions_write_pngs_with_their_series(small_runs, tmp_path):
    cont, static = small_runs
    assert cont.metrics.num_preemptions > 0  # 20 blocks is tight: the kv plot marks preemptions
    assert plots.plot_timeline(static, tmp_path / "t.png") == list(plots.STATES)
    assert plots.plot_steps(cont, tmp_path / "s.png") == ["decode tokens", "prefill tokens", "token budget",
                                                           "step time"]
    assert plots.plot_steps(static, tmp_path / "s2.png") == ["decode tokens", "prefill tokens",
                                                              "idle slots (static padding)", "step time"]
    assert plots.plot_kv(cont, tmp_path / "k.png") == ["KV blocks in use", "KV capacity", "preemption"]
    assert plots.plot_cdfs(small_runs, tmp_path / "c.png") == ["continuous", "static"]
    pts = [{**r.metrics.to_dict(), "scheduler": r.config.scheduler, "budget": b}
           for r in small_runs for b in (1, 2)]
    assert plots.plot_sweep(pts, tmp_path / "w.png", ["scheduler"], "budget", {"tpot_p99": 50},
                            pts[0]) == ["scheduler=continuous", "scheduler=static"]
    for name in ("t", "s", "s2", "k", "c", "w"):
        assert _png(tmp_path / f"{name}.png"), name


def test_timeline_shows_preemption_and_every_request_finishes(small_runs):
    grid = plots.timeline_grid(small_runs[0])
    assert (grid == plots._CODE["preempted"]).any()
    assert (grid[:, -1] != plots._CODE["waiting"]).all()


def test_batching_report_has_every_section(tmp_path):
    report = run_batching_report(EngineConfig(), tmp_path, quick=True, progress=False,
                                 factory=FakeEngineFactory(), mixed_path=None)
    text = report.read_text()
    for heading in ("## (a) Static vs continuous", "## (b) Long prefills", "## (c) The token budget",
                    "## (d) FCFS vs priority", "## (f) Policies ferry enforces: urgent",
                    "## (f) Policies ferry enforces: short prompts"):
        assert heading in text
    # The quick 8-request case: 8 lengths of mean 12 (96 tokens), the longest 60: 1 - 96 / (8 * 60) = 80%,
    # and the fake engine's static batch wastes exactly that.
    assert (QUICK.waste_n, QUICK.waste_mean, QUICK.waste_max) == (8, 12, 60)
    assert "- 8-request case: the static batch wasted 80.0% of its generation slots " \
           "(1 - sum(L) / (n * max L) = 80.0%;" in text
    images = [line[line.rindex("](") + 2:-1] for line in text.splitlines() if line.startswith("![")]
    assert len(images) == 10
    assert all(_png(tmp_path / name) for name in images)
    # (f) on its own: priority preemption gives urgent requests their first token sooner than the
    # priority policy alone, and the caps give short prompts theirs sooner than no caps.
    report = run_batching_report(EngineConfig(), tmp_path / "f", quick=True, progress=False,
                                 factory=FakeEngineFactory(), plots=False, only="f")
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in report.read_text().splitlines()
            if line.startswith("| ") and line[2:3].isalpha()}
    assert float(rows["priority + preemption"][1]) < float(rows["priority"][1])
    assert float(rows[f"threshold {QUICK.caps_threshold}, 1 long, 4 partial"][1]) < float(rows["no caps"][1])


# ---------------------------------------------------------------- the commands, on the embedded model
def ferry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ferry.cli", *args], capture_output=True, text=True, timeout=600)


def test_bench_offline_and_online_write_json_and_plots(tmp_path):
    common = ["--num-prompts", "4", "--input-len", "24", "--output-len", "6", "--no-progress"]
    p = ferry("bench", "offline", *common, "--output-json", str(tmp_path / "off.json"),
              "--plot", str(tmp_path / "plots"), "--max-num-batched-tokens", "32")
    assert p.returncode == 0, p.stderr
    d = json.loads((tmp_path / "off.json").read_text())
    assert d["completed"] == 4 and d["total_output_tokens"] == 24 and d["engine"]["max_num_batched_tokens"] == 32
    assert sorted(x.name for x in (tmp_path / "plots").iterdir()) == \
        ["offline-cdf.png", "offline-kv.png", "offline-steps.png", "offline-timeline.png"]
    p = ferry("bench", "online", *common, "--request-rate", "20", "--output-json", str(tmp_path / "on.json"))
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "on.json").read_text())["request_rate"] == 20.0


def test_bench_sweep_marks_the_best_configuration_within_the_slo(tmp_path):
    p = ferry("bench", "sweep", "--num-prompts", "3", "--input-len", "40", "--output-len", "4", "--no-progress",
              "--max-num-batched-tokens", "16,64", "--slo", "ttft_p99=600000", "--output-json",
              str(tmp_path / "s.json"), "--plot", str(tmp_path))
    assert p.returncode == 0, p.stderr
    d = json.loads((tmp_path / "s.json").read_text())
    assert [pt["max_num_batched_tokens"] for pt in d["points"]] == [16, 64]
    assert d["best"] in {pt["label"] for pt in d["points"]} and "<- best" in p.stdout
    assert _png(tmp_path / "sweep.png")


def test_bench_input_errors_are_messages():
    p = ferry("bench", "offline", "--no-progress")
    assert p.returncode == 2 and "give a workload" in p.stderr
    p = ferry("bench", "online", "--num-prompts", "2", "--request-rate", "-1")
    assert p.returncode == 2 and "request rate must be > 0" in p.stderr
    p = ferry("bench", "sweep", "--num-prompts", "2", "--slo", "foo=1")
    assert p.returncode == 2 and "SLO key 'foo'" in p.stderr


# SmolLM2-135M's products: hidden 576, 3 KV heads of 64, MLP 1536, 49152 tokens.
SMOLLM2_SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                  "lm_head": (49152, 576)}


def test_bench_kernels_times_every_implementation_against_its_bound(llm):
    from ferry.bench.kernels import SHAPES, bench_kernels, format_kernels

    report = bench_kernels(llm.engine.executor.model, rows=[1, 3], reps=1)
    b = report["bounds"]
    # A 1 GiB sum and a 1024^3 product timed now: within what any machine this runs on can do.
    assert 0.1 < b["dram_gb_s"] < 5000 and 1 < b["fma_gflop_s"] < 1e6
    assert [(r["shape"], r["m"]) for r in report["rows"]] == [(s, m) for s in SHAPES for m in (1, 3)]
    for r in report["rows"]:
        n, k = SMOLLM2_SHAPES[r["shape"]]
        assert (r["n"], r["k"]) == (n, k)
        # Q4_1 weights take 20 bytes a block of 32, the lm_head's Q8_0 34; float32 4 bytes a weight.
        quant_bytes = n * k // 32 * (34 if r["shape"] == "lm_head" else 20)
        for impl in ("ferry_quant", "ferry_f32", "torch_f32", "numpy_openblas_f32"):
            c = r[impl]
            seconds = c["ms"] / 1e3
            assert c["gflop_s"] * 1e9 * seconds == pytest.approx(2 * r["m"] * n * k), (r["shape"], impl)
            weights = quant_bytes if impl == "ferry_quant" else n * k * 4
            assert c["gb_s"] * 1e9 * seconds == pytest.approx(weights), (r["shape"], impl)
    assert report["rows"][0]["quant_type"] == "Q4_1" and report["rows"][-1]["quant_type"] == "Q8_0"
    assert "lm_head" in format_kernels(report)


def test_bench_kernels_holds_q8_products_to_the_int8_peak(llm, monkeypatch):
    """The q8 products' bound is the int8 multiply-add peak of the variant in use, not the float32
    FMA peak; the float32 products' is the FMA peak. With fixed bounds and a fixed 2 ms a call (over
    30 layers: 1/15 ms a product), the shares of the bound have known values."""
    from ferry.bench import kernels

    monkeypatch.setattr(kernels, "machine_bounds", lambda threads: {
        "dram_gb_s": 100.0, "fma_gflop_s": 1000.0, "int8_gmac_s": 2000.0, "threads": threads})
    monkeypatch.setattr(kernels, "_time", lambda fn, reps: 0.002)
    rows = {r["shape"]: r for r in kernels.bench_kernels(llm.engine.executor.model, rows=[64], reps=1)["rows"]}
    # qkv, q8: 64 x 960 x 576 multiply-adds at 2000 G/s = 17.69 us (its 345600 bytes at 100 GB/s take 3.5 us)
    assert rows["qkv"]["ferry_quant"]["of_bound"] == pytest.approx(0.265421, rel=1e-5)
    # ... float32: 2 x 64 x 960 x 576 FLOPs at 1000 GFLOP/s = 70.78 us, more than the 1/15 ms it took
    assert rows["qkv"]["ferry_f32"]["of_bound"] == pytest.approx(1.061683, rel=1e-5)
    # lm_head, q8, one product a call: 64 x 49152 x 576 at 2000 G/s = 905.97 us of 2 ms
    assert rows["lm_head"]["ferry_quant"]["of_bound"] == pytest.approx(0.452985, rel=1e-5)
    # A variant without an int8 instruction (peak 0): the q8 products fall back to the FMA bound.
    monkeypatch.setattr(kernels, "machine_bounds", lambda threads: {
        "dram_gb_s": 100.0, "fma_gflop_s": 1000.0, "int8_gmac_s": 0.0, "threads": threads})
    rows = {r["shape"]: r for r in kernels.bench_kernels(llm.engine.executor.model, rows=[64], reps=1)["rows"]}
    assert rows["qkv"]["ferry_quant"]["of_bound"] == pytest.approx(1.061683, rel=1e-5)


def test_the_int8_peak_is_measured_on_the_variant_in_use():
    """The portable variant has no int8 multiply-add instruction (0); each vector variant multiplies
    at least 16 int8 pairs per instruction, a billion a second."""
    from ferry.bench.kernels import int8_peak
    from ferry.model.kernels import load_kernels

    so = load_kernels()
    if so is None or so.quant_q8_isa(-2) == 0:
        pytest.skip("no vector q8 variant here")
    assert so.int8_peak(0, 1000) == 0.0
    assert 16 < int8_peak() < 1e6


def test_bench_accuracy_compares_next_token_predictions(llm, parity_prompts):
    from ferry import LLM
    from ferry.bench.accuracy import compare

    prompts = parity_prompts[:3]
    same = compare(llm, llm, prompts)
    assert same["positions"] == sum(len(p) - 1 for p in prompts)
    assert same["top1_agreement"] == 1.0 and same["max_abs_logprob_diff"] == 0.0
    other = compare(llm, LLM(load_format="dummy"), prompts)  # random weights: another model
    assert other["top1_agreement"] < 0.5 and other["mean_abs_logprob_diff"] > 1.0
