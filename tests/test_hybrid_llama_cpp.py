"""The hybrid families from the GGUF files llama.cpp's own converter writes (convert_hf_to_gguf.py,
fetched by `make test` into .venv/llama.cpp): tiny random models made by transformers (Qwen3.5 and
Qwen3.5-MoE, LFM2, Granite 4 hybrid dense and MoE, Nemotron-H dense and MoE; the same shapes as
tests/test_hybrid_*.py, over SmolLM2's tokenizer saved beside them), converted to F32 (Qwen3.5 with
--no-mtp) and one to Q8_0. Through ferry.LLM, with a 16-token budget that cuts conv windows, block
size 4 and preemption: prompt logprobs, greedy tokens and their logprobs equal
transformers' (float32, eager) within 1e-4; the Q8_0 file's against transformers on the same weights
taken to Q8_0 and back."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from ferry.model.gguf_convert import convert_gguf
from tests import test_hybrid_lfm2 as lfm2
from tests import test_hybrid_mamba2 as mamba2
from tests import test_hybrid_qwen3_5 as qwen3_5
from tests.hybrid_models import (E2E_PROMPTS, engine, engine_logprob_diff, greedy_matches, hf_greedy_all, rounded,
                                 skip_quantized_without_kernels)
from tests.llama_cpp import CONVERTER, HAS_CONVERTER, LLAMA_CPP

pytestmark = pytest.mark.skipif(not HAS_CONVERTER, reason=f"llama.cpp's converter is not at {CONVERTER}: run "
                                "`make test` (it fetches it into .venv/llama.cpp) or set FERRY_LLAMA_CPP to a "
                                "llama.cpp source tree")

# SmolLM2's tokenizer: a BPE whose pre-tokenizer the converter knows (it refuses unknown ones), so
# the models' vocabularies are its 49152 tokens.
VOCAB = 49152
TOL = 1e-4

# For Qwen3.5-MoE transformers swaps in its own Qwen3.5 tokenizer class whatever tokenizer.json
# holds, and the converter then meets a pre-tokenizer it does not know: this runs the converter with
# the saved tokenizer.json loaded as it is (only the vocabulary's reading changes, no tensor).
TOKENIZER_AS_SAVED = """import os, runpy, sys
from transformers.models.auto import tokenization_auto
tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.difference_update({"qwen3_5_moe", "qwen3_5_moe_text"})
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass(frozen=True)
class Family:
    """A tiny model of one family and what llama.cpp's converter makes of it."""

    make: Callable[[Path], torch.nn.Module]  # the model, saved in the directory given
    arch: str  # the GGUF's general.architecture
    flags: tuple[str, ...] = ()  # the converter's
    tokenizer_as_saved: bool = False  # run the converter under TOKENIZER_AS_SAVED


def mamba2_family(kind: str, arch: str) -> Family:
    return Family(lambda p: mamba2.make_model(kind, p, vocab_size=VOCAB), arch)


def qwen3_5_family(kind: str, arch: str) -> Family:
    return Family(lambda p: qwen3_5.make_model(kind, p, vocab_size=VOCAB, **qwen3_5.GGUF_OVER[kind]), arch,
                  ("--no-mtp",), tokenizer_as_saved=kind == "moe")


FAMILIES = {
    "qwen3.5": qwen3_5_family("dense", "qwen35"),
    "qwen3.5-moe": qwen3_5_family("moe", "qwen35moe"),
    "lfm2": Family(lambda p: lfm2.make_model(p, vocab_size=VOCAB), "lfm2"),
    # transformers 5 renames Granite's layer_types to linear_attention / full_attention, and the
    # converter then writes 0 KV heads for every layer: ferry finds the attention layers by their tensors.
    "granite": mamba2_family("granite", "granitehybrid"),
    "granite-dense": mamba2_family("granite-dense", "granitehybrid"),
    # transformers 5 writes num_experts_per_tok into every Nemotron-H config, which the converter
    # takes for nemotron_h_moe even without experts (its feed_forward_length then all 0).
    "nemotron-h": mamba2_family("nemotron-dense", "nemotron_h_moe"),
    "nemotron-h-moe": mamba2_family("nemotron", "nemotron_h_moe"),
}


def save_tokenizer(model_dir: Path, tokenizer_dir: Path) -> None:
    """SmolLM2's tokenizer files beside the checkpoint, where the converter reads its vocabulary."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, model_dir / name)


def convert(family: Family, model_dir: Path, out: Path, outtype: str) -> Path:
    """llama.cpp's converter on ``model_dir`` (its own gguf-py on the path); its log in the error."""
    env = dict(os.environ, PYTHONPATH=str(LLAMA_CPP / "gguf-py"))
    run = [sys.executable] + (["-c", TOKENIZER_AS_SAVED] if family.tokenizer_as_saved else [])
    done = subprocess.run(run + [str(CONVERTER), str(model_dir), "--outtype", outtype, "--outfile", str(out),
                                 *family.flags], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"convert_hf_to_gguf.py failed:\n{done.stderr[-4000:]}"
    return out


def gguf_arch(path: Path) -> str:
    """The GGUF's general.architecture (transformers' reader: the gguf library's takes seconds over a
    vocabulary of 49152 tokens)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    return read_gguf_metadata(str(path))[0]["general.architecture"]


def converted(family: str, tmp_path: Path, tokenizer_dir: Path, outtype: str = "f32"):
    """``family``'s tiny model (transformers') and llama.cpp's GGUF of it (the tokenizer from
    ``tokenizer_dir``)."""
    spec = FAMILIES[family]
    hf = tmp_path / "hf"
    hf.mkdir()
    model = spec.make(hf)
    save_tokenizer(hf, tokenizer_dir)
    gguf = convert(spec, hf, tmp_path / f"{family}-{outtype}.gguf", outtype)
    assert gguf_arch(gguf) == spec.arch
    return model, gguf


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_converters_f32_gguf_matches_transformers(family, tmp_path, monkeypatch, embedded_dir):
    """Prompt logprobs (in chunks that cut conv windows, preempted), then greedy tokens and their
    logprobs equal transformers'. (quantization "none": ferry's float copy of the file, the same
    tensor reading as "gguf" without reading the file twice.)"""
    model, gguf = converted(family, tmp_path, embedded_dir)
    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    llm = engine(str(gguf), quantization="none", state_snapshot_interval=12)
    assert llm.engine.executor.model_config.architecture == model.config.architectures[0]
    diff = engine_logprob_diff(llm, model, E2E_PROMPTS)
    print(f"{family} llama.cpp f32 gguf (engine) max |d prompt logprob| {diff:.2e}")
    assert diff < TOL
    assert llm.engine.num_preemptions > 0
    greedy_matches(llm, model, E2E_PROMPTS, hf_greedy_all(model, E2E_PROMPTS))


def test_the_converters_q8_0_gguf_keeps_its_blocks_and_matches_transformers_on_the_same_weights(tmp_path,
                                                                                               monkeypatch,
                                                                                               embedded_dir):
    """Qwen3.5 written by the converter with --outtype q8_0: its matrices stay Q8_0 blocks, and the
    prompt logprobs and greedy tokens equal transformers' on the weights taken to Q8_0 and back (value
    heads as wide as a block, so llama.cpp's reorder of them moves whole blocks)."""
    from ferry.model.quant import QuantWeight

    skip_quantized_without_kernels("Q8_0")
    model, gguf = converted("qwen3.5", tmp_path, embedded_dir, "q8_0")
    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    llm = engine(str(gguf), quantization="gguf")
    # Served quantized, the conversion holds no float32 copy, and its config (read from the blocks'
    # shapes) is the one a conversion with the float weights writes.
    conv = llm.engine.executor.model_dir
    assert not (conv / "model.safetensors").exists()
    convert_gguf(gguf, tmp_path / "with-floats")
    assert json.loads((conv / "config.json").read_text()) == json.loads(
        (tmp_path / "with-floats" / "config.json").read_text())
    layers = llm.engine.executor.model.layers
    for i in (0, 3):  # a DeltaNet layer and an attention layer
        assert any(isinstance(w, QuantWeight) for w in vars(layers[i].mixer).values())
    ref = rounded(model, "Q8_0", qwen3_5.quantized)
    diff = engine_logprob_diff(llm, ref, E2E_PROMPTS)
    print(f"qwen3.5 llama.cpp q8_0 gguf (engine) max |d prompt logprob| {diff:.2e} "
          f"(against the unrounded model {engine_logprob_diff(llm, model, E2E_PROMPTS):.2e})")
    assert diff < TOL
    greedy_matches(llm, ref, E2E_PROMPTS, hf_greedy_all(ref, E2E_PROMPTS))
