"""The hybrid models through the engine, beyond parity: random weights of each family's declared
shapes (``load_format="dummy"``), the state slots sized from the memory budget beside the KV blocks
(only attention layers hold KV), and the settings such a model refuses by name."""
from __future__ import annotations

import json

import pytest

from ferry import LLM, SamplingParams
from ferry.config import EngineConfig
from ferry.model.config import ModelConfig
from ferry.model.shard_plan import ShardPlan

SMALL = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             eos_token_id=319, bos_token_id=1)
CONFIGS = {
    "qwen3_5": dict(SMALL, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", intermediate_size=96,
                    num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                    layer_types=["linear_attention"] * 3 + ["full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
    "lfm2": dict(SMALL, architectures=["Lfm2ForCausalLM"], model_type="lfm2", intermediate_size=96, num_hidden_layers=4,
                 conv_L_cache=3, layer_types=["conv", "full_attention", "conv", "conv"], block_auto_adjust_ff_dim=False),
    "granite": dict(SMALL, architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid",
                    intermediate_size=32, shared_intermediate_size=64, num_hidden_layers=4, num_local_experts=0,
                    layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=4, mamba_d_head=16,
                    mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=8,
                    position_embedding_type="nope"),
    "nemotron_h": dict(SMALL, architectures=["NemotronHForCausalLM"], model_type="nemotron_h", intermediate_size=96,
                       num_hidden_layers=4, hybrid_override_pattern="M*M-", mamba_num_heads=4, mamba_head_dim=16,
                       ssm_state_size=8, n_groups=1, conv_kernel=4, expand=1, chunk_size=8, head_dim=16),
}


def write(tmp_path, name: str) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIGS[name]))
    return str(d)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_weights_of_each_family_run_and_hold_state_slots(tmp_path, name):
    path = write(tmp_path, name)
    cfg = ModelConfig.from_dir(path)
    assert cfg.recurrent_layers and cfg.attention_layers
    llm = LLM(model=path, load_format="dummy", kv_cache_memory_gb=0.01, max_num_seqs=4, block_size=4)
    ex = llm.engine.executor
    # Two slots a sequence (running requests and snapshots); K/V only for the attention layers.
    assert ex.num_state_slots == 8 and len(ex.kv_caches) == cfg.num_layers
    assert sum(isinstance(c, tuple) for c in ex.kv_caches) == len(cfg.attention_layers)
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert llm.engine.kv.states.num_used == 0  # every slot back once the requests are done


def test_the_states_come_out_of_the_memory_budget(tmp_path):
    path = write(tmp_path, "qwen3_5")
    state = 4 * ModelConfig.from_dir(path).state_floats
    few = LLM(model=path, load_format="dummy", kv_cache_memory_gb=0.01, max_num_seqs=4, num_state_slots=2)
    many = LLM(model=path, load_format="dummy", kv_cache_memory_gb=0.01, max_num_seqs=4, num_state_slots=40)
    bytes_per_block = (0.01 * 2**30 - 2 * state) / few.engine.num_kv_blocks
    assert few.engine.num_kv_blocks - many.engine.num_kv_blocks == pytest.approx(38 * state / bytes_per_block, abs=1)
    with pytest.raises(ValueError, match="leaves no room for KV blocks"):
        LLM(model=path, load_format="dummy", kv_cache_memory_gb=0.001, num_state_slots=10_000)


def test_what_a_hybrid_model_refuses_is_named(tmp_path):
    path = write(tmp_path, "lfm2")
    with pytest.raises(ValueError, match="recurrent layers are not split"):
        ShardPlan.make(ModelConfig.from_dir(path), 0, 2)
    with pytest.raises(ValueError, match="scheduler 'static' does not serve models with recurrent layers"):
        LLM(model=path, load_format="dummy", kv_cache_memory_gb=0.01, scheduler="static")
    with pytest.raises(ValueError, match="state_snapshot_interval"):
        EngineConfig(block_size=16, state_snapshot_interval=20)
