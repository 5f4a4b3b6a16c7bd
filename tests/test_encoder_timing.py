"""The vision encoder's time where users see it: per step (StepStats), in the step profiler and in
`ferry bench --profile` (its share of the step, ms per image, cache hits), on a tiny random Qwen3-VL;
bench workloads with images (``--image-size`` and per-request ``image_sizes`` in a workload file)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ferry import LLM, SamplingParams
from ferry.bench.images import with_images
from ferry.bench.workload import WorkloadRequest, load_workload, parse_image_size, save_workload
from ferry.engine.profiler import StepProfiler
from ferry.multimodal.processor import ImagePrompter
from tests.vl_models import image, make_vl_model

P = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vl_timing")
    make_vl_model(path)
    return path


def test_encoder_seconds_and_cache_hits_per_step_and_in_the_profile(vl_dir):
    llm = LLM(model=str(vl_dir), max_num_batched_tokens=64, max_num_seqs=4, block_size=4, num_kv_blocks=64)
    prompter = llm.engine.image_prompter
    a, b = image(64, 64, 1), image(48, 64, 2)
    prompts = [prompter.encode(f"w5 {P} w9", [a]),
               prompter.encode(f"w6 {P} w7 {P} w8", [a, b]),  # a again in the same step: a hit
               prompter.encode(f"w4 {P} w3", [b])]  # b again: a hit
    prof = StepProfiler()
    llm.engine.attach_profiler(prof)
    try:
        llm.generate([p[0] for p in prompts], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                     images=[p[1] for p in prompts])
    finally:
        llm.engine.attach_profiler(None)
    steps = llm.engine.step_stats
    seconds = [t for s in steps for t in s.encoder_seconds]
    assert len(seconds) == 2 and all(t > 0 for t in seconds)  # two distinct images, each encoded once
    assert sum(s.num_encoder_cache_hits for s in steps) == 2
    assert llm.engine.executor.images.encoder.num_encoded == 2
    summary = prof.encoder_summary()
    assert summary["images"] == 2 and summary["cache_hits"] == 2
    assert summary["ms_per_image"]["max"] == pytest.approx(1e3 * max(seconds))
    # The encoder is a part of the prefill step, and its time is inside it.
    prefill = [s for shape, s in prof.to_dict().items() if "encoder" in s["parts"]]
    assert prefill and all(0 < s["parts"]["encoder"]["share"] < 1 for s in prefill)
    assert "vision encoder: 2 images encoded" in prof.table() and "2 encoder cache hits" in prof.table()


def test_a_text_only_profile_says_nothing_of_an_encoder(llm):
    prof = StepProfiler()
    llm.engine.attach_profiler(prof)
    try:
        llm.generate([[1] * 8], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    finally:
        llm.engine.attach_profiler(None)
    assert prof.encoder_summary() is None and "vision encoder" not in prof.table()


def test_workload_image_sizes_round_trip_and_become_images(vl_dir, tmp_path):
    reqs = [WorkloadRequest([7, 8], 4, arrival_time=0.5, image_sizes=((64, 64), (32, 48))), WorkloadRequest([9], 2)]
    save_workload(reqs, tmp_path / "w.json")
    back = load_workload(tmp_path / "w.json")
    assert back == reqs  # arrival_time and priority stay where they were
    prompter = ImagePrompter.for_model(vl_dir)
    made = with_images(back, prompter)
    assert made[1] == back[1]  # no image asked: as it was
    ids, features = made[0].prompt_token_ids, made[0].images
    assert ids[-2:] == [7, 8] and len(features) == 2 and features[0].hash != features[1].hash
    assert len(ids) == 2 + (16 + 2) + (6 + 2)  # 64x64: 16 tokens, 32x48: 2x3, each between start and end
    # --image-size gives an image to each request that names none.
    both = with_images(back, prompter, "64x64")
    assert len(both[1].images) == 1 and both[1].image_sizes == ((64, 64),) and len(both[0].images) == 2
    assert len({f.hash for r in both for f in r.images}) == 3  # every picture its own
    with pytest.raises(ValueError, match="takes none"):
        with_images(back, None)
    for bad in ("448", "0x5", "axb"):
        with pytest.raises(ValueError, match="WxH|>= 1"):
            parse_image_size(bad)


def test_bench_profile_shows_the_encoder(vl_dir, tmp_path):
    out = tmp_path / "b.json"
    p = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "offline", "--model", str(vl_dir),
                        "--num-prompts", "3", "--input-len", "8", "--output-len", "3", "--image-size", "64x64",
                        "--profile", "--no-progress", "--max-num-batched-tokens", "32", "--max-num-encoder-tokens", "4",
                        "--output-json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "vision encoder: 3 images encoded" in p.stdout and "0 encoder cache hits" in p.stdout
    d = json.loads(out.read_text())
    assert d["total_input_tokens"] == 3 * (8 + 16 + 2)
    # Each 16-token image over four steps of 4 tokens' worth: one time per image, summed over its steps.
    assert d["encoder"]["images"] == 3 and d["encoder"]["ms_per_image"]["median"] > 0
    assert any("encoder" in s["parts"] for s in d["profile"].values())
    # Steps where every prompt waits at an image run encoder work alone, a shape of their own.
    assert d["profile"]["encoder"]["steps"] >= 3 and "encoder" in d["profile"]["encoder"]["parts"]
    assert "encoder: " in p.stdout
    p = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "offline", "--num-prompts", "1",
                        "--input-len", "4", "--output-len", "1", "--image-size", "64x64", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "takes none" in p.stderr
