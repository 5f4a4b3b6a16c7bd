"""An architecture declared and registered from this file alone (one declaration, one registry
entry) runs through both decode paths, the fused C one and torch's, with the same results; a part
the C decode has no op for sends the model to the torch path, with equal results."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.model.arch import ARCHITECTURES, Architecture, register
from ferry.model.arch.parts import LayerSpec, MLPSpec, llama_layers
from ferry.model.kernels import load_kernels

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="the fused decode needs the C kernels")


def toy_configure(d: dict[str, Any]) -> dict[str, Any]:
    """Every option the existing parts have, at once: q/k norms, biases, output norms, a window on
    every other layer, a scaled embedding and soft-capped logits."""
    n = d["num_hidden_layers"]
    layers = llama_layers(d, qk_norm=True, bias=True, out_norm=True, windows=[6 if i % 2 == 0 else None for i in range(n)])
    return {"layers": layers, "embed_scale": 2.0, "final_logit_softcap": 20.0}


# With output norms the MLP's input norm needs its own name (Gemma's).
NAMES = {"mlp_norm": ("pre_feedforward_layernorm", "ffn_norm")}
TOY = Architecture("ToyForCausalLM", "toy", configure=toy_configure, norm_offset=1.0, names=NAMES)


@dataclass(frozen=True)
class UnfusedMLPSpec(MLPSpec):
    """The gated MLP under another kind, whose part has no op in the C decode."""

    kind = "unfused_mlp"


def unfused_configure(d: dict[str, Any]) -> dict[str, Any]:
    out = toy_configure(d)
    out["layers"] = tuple(LayerSpec(layer.mixer, UnfusedMLPSpec(layer.mlp.act, layer.mlp.out_norm))
                          for layer in out["layers"])
    return out


UNFUSED = Architecture("UnfusedToyForCausalLM", "unfused_toy", configure=unfused_configure, norm_offset=1.0,
                       names=NAMES)

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000.0)
PROMPTS = [[3, 17, 42, 9, 88, 5, 61, 23], [7, 7, 100, 2], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]]


@pytest.fixture
def registered():
    register(TOY)
    register(UNFUSED)
    yield
    del ARCHITECTURES[TOY.hf_name], ARCHITECTURES[UNFUSED.hf_name]


def write_model(path: Path, arch: Architecture) -> Path:
    """A model directory of ``arch`` with random weights (the same seed: the same weights for both)."""
    from safetensors.torch import save_file

    from ferry.model.config import ModelConfig
    from ferry.model.weights import dummy_weights

    path.mkdir(exist_ok=True)
    d = dict(CONFIG, architectures=[arch.hf_name], model_type=arch.model_type)
    cfg = ModelConfig.from_dict(d)
    g = torch.Generator().manual_seed(5)
    # Larger than dummy's 0.02 so the tokens are decided by clear margins; norms near 1 + w.
    weights = {k: (v + torch.randn(v.shape, generator=g) * (0.1 if v.dim() == 1 else 0.15)).contiguous()
               for k, v in dummy_weights(cfg, seed=3).items()}
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(d))
    return path


def decode(llm: LLM) -> list[tuple[list[int], list[float]]]:
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def same(a: list, b: list, tol: float = 2e-4) -> None:
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) < tol


def test_a_toy_architecture_runs_through_both_decode_paths(registered, tmp_path):
    llm = LLM(model=str(write_model(tmp_path / "toy", TOY)), num_kv_blocks=64)
    model = llm.engine.executor.model
    assert model.fused is not None, "every part of the toy has its ops in the C decode"
    calls = []
    run = model.fused.run
    model.fused.run = lambda *a, **k: (calls.append(1), run(*a, **k))[1]
    fused = decode(llm)
    assert len(calls) >= 11  # each decode step of the three requests went through the C op list
    model.fused = None
    torch_path = decode(llm)
    same(fused, torch_path)
    assert len({tuple(t) for t, _ in fused}) > 1  # the requests decode different tokens


def test_a_part_without_a_c_op_runs_on_the_torch_path_with_equal_results(registered, tmp_path, monkeypatch):
    from ferry.model.fused_decode import NotFused
    from ferry.model.layers import PARTS
    from ferry.model.layers.mlp import GatedMLP

    @dataclass
    class UnfusedMLP(GatedMLP):
        def ops(self, ctx: Any, cache: Any = None) -> list:
            raise NotFused("a part the C decode lacks")

    monkeypatch.setitem(PARTS, "unfused_mlp", UnfusedMLP.build)
    llm = LLM(model=str(write_model(tmp_path / "unfused", UNFUSED)), num_kv_blocks=64)
    assert llm.engine.executor.model.fused is None
    assert isinstance(llm.engine.executor.model.layers[0].mlp, UnfusedMLP)
    got = decode(llm)
    llm.close()
    reference = LLM(model=str(write_model(tmp_path / "toy", TOY)), num_kv_blocks=64)
    assert reference.engine.executor.model.fused is not None
    same(got, decode(reference))
