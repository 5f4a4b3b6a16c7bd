"""The memory-floor figures of ``ferry bench offline``: the read-bandwidth probe of the engine's
thread team, and one request's decode bandwidth against it (ferry/bench/bandwidth.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ferry.model.kernels import load_kernels


def test_the_probe_reads_memory_at_a_sane_rate():
    """A buffer larger than the caches, every page backed: between 0.5 GB/s and 1 TB/s; an empty
    buffer measures nothing (0.0)."""
    from ferry.bench.bandwidth import read_bandwidth

    if load_kernels() is None:
        pytest.skip("no kernels here")
    bw = read_bandwidth(128 * 2**20, 3)
    assert 0.5e9 < bw < 1e12
    assert load_kernels().read_bandwidth(0, 3) == 0.0


def test_bench_offline_prints_the_probe_and_the_decode_bandwidth(tmp_path):
    """One request: the probe, the weight bytes a token reads, the decode's GB/s and its fraction of
    the probe, and with --profile each part's bytes and GB/s; all in the JSON too."""
    if load_kernels() is None:
        pytest.skip("no kernels here")
    out = tmp_path / "off.json"
    p = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "offline", "--num-prompts", "1", "--input-len",
                        "16", "--output-len", "12", "--no-progress", "--profile", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    for text in ("read bandwidth (probe)", "weights read per token", "decode bandwidth", "% of the probe",
                 "one-row decode steps by part"):
        assert text in p.stdout, p.stdout
    floor = json.loads(out.read_text())["memory_floor"]
    assert 0.5 < floor["probe_gb_s"] < 1000 and floor["threads"] >= 1
    # SmolLM2-135M's products and LM head: 30 layers, tens of MiB in any of its types.
    assert 20 * 2**20 < floor["weight_bytes_per_token"] < 2**30
    assert 0 < floor["decode_gb_s"] and 0 < floor["fraction_of_probe"] < 2
    parts = floor["parts"]
    assert parts["lm_head"]["bytes"] > 0 and parts["gate_up"]["bytes"] > parts["o_proj"]["bytes"] > 0
    assert sum(v["bytes"] for v in parts.values()) == floor["weight_bytes_per_token"]
