"""Tensor parallelism over torch.distributed (gloo, 2 rank processes): the same greedy tokens as
one process, with chunked prefill, preemption and speculation too; a dead or hung rank stops
the engine with an error that names it, never a hang."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.core.outputs import ExecutorDead
from ferry.core.sampling_params import StructuredOutputs
from ferry.model.config import ModelConfig
from ferry.model.quant import QuantWeight, dequantize, repack
from ferry.model.tensor_parallel import ShardPlan, shard_cols, shard_rows, split


@pytest.fixture(scope="module")
def llm(exact_llm):
    """Exact products, so ranks must give one process's very tokens."""
    return exact_llm


NEW_TOKENS = 48


def _cfg(heads: int, kv_heads: int, inter: int = 1536, vocab: int = 1000) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64 * heads, "num_attention_heads": heads,
                                  "num_key_value_heads": kv_heads, "head_dim": 64, "intermediate_size": inter,
                                  "num_hidden_layers": 1, "vocab_size": vocab, "rms_norm_eps": 1e-5,
                                  "max_position_embeddings": 128})


@pytest.mark.parametrize("heads,kv,world", [(9, 3, 2), (9, 3, 3), (32, 8, 4), (8, 2, 4), (8, 1, 2), (12, 12, 5)])
def test_shard_plan_covers_every_head_column_and_row_once(heads, kv, world):
    cfg = _cfg(heads, kv)
    plans = [ShardPlan.make(cfg, r, world) for r in range(world)]
    group = heads // kv
    q_owner = {}
    for p in plans:
        for h in range(*p.q_heads):
            assert h not in q_owner
            q_owner[h] = p.rank
            # a rank holds the KV head its query heads read
            assert p.kv_heads[0] <= h // group < p.kv_heads[1]
        assert p.num_kv_heads <= p.max_kv_heads
    assert sorted(q_owner) == list(range(heads))
    for field, n in (("mlp", cfg.intermediate_size), ("vocab", cfg.vocab_size)):
        spans = [getattr(p, field) for p in plans]
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(p.mlp[0] % 32 == 0 for p in plans)  # quantized blocks are never cut


def test_experts_are_cut_on_k_quant_super_blocks_where_they_can_be():
    """Qwen3-30B-A3B's experts (768 columns) split on 256-weight blocks over 2 ranks, so their
    K-quant down projections stay quantized; 96 columns split on 32."""
    def moe(intermediate: int) -> ModelConfig:
        return ModelConfig.from_dict({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 1000, "hidden_size": 2048,
                                      "intermediate_size": 6144, "num_hidden_layers": 2, "num_attention_heads": 32,
                                      "num_key_value_heads": 4, "head_dim": 128, "num_experts": 8,
                                      "num_experts_per_tok": 2, "moe_intermediate_size": intermediate})

    cuts = [ShardPlan.make(moe(768), r, 2).experts for r in range(2)]
    assert cuts == [(0, 512), (512, 768)] and all(a % 256 == 0 for a, _ in cuts)
    small = ShardPlan.make(moe(96), 1, 2).experts
    assert small[0] % 32 == 0 and small[1] == 96


def test_shard_plan_refuses_what_does_not_split():
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not split"):
        ShardPlan.make(_cfg(8, 2), 0, 3)
    assert split(10, 3, 0) == (0, 4) and split(10, 3, 2) == (7, 10)
    assert split(96, 2, 1, align=32) == (64, 96)  # 3 blocks of 32: 2 + 1


def test_quantized_shards_equal_the_dequantized_slices():
    rng = torch.Generator().manual_seed(0)
    n, k = 6, 128
    raw = torch.randint(0, 255, (n, k // 32 * 18), dtype=torch.uint8, generator=rng).numpy()  # GGUF Q4_0: 18 B a block
    raw.reshape(n, k // 32, 18)[..., :2] = torch.tensor([0, 60], dtype=torch.uint8).numpy()  # sane f16 scales
    w = repack(raw, "Q4_0", (n, k))
    full = dequantize(w)
    cols = shard_cols(w, 32, 96)
    assert isinstance(cols, QuantWeight) and torch.equal(dequantize(cols), full[:, 32:96])
    assert torch.equal(dequantize(shard_rows(w, 2, 5)), full[2:5])
    uneven = shard_cols(w, 16, 80)  # off the blocks: dequantized
    assert not isinstance(uneven, QuantWeight) and torch.equal(uneven, full[:, 16:80])


@pytest.fixture(scope="module")
def tp_llm():
    llm = LLM(quant_activations="exact", tensor_parallel_size=2)
    yield llm
    llm.close()


def test_greedy_tokens_match_one_process(llm, tp_llm, parity_prompts):
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    llm.engine.reset_prefix_cache()
    ref = llm.generate(parity_prompts, sp, use_tqdm=False)
    outs = tp_llm.generate(parity_prompts, sp, use_tqdm=False)
    for prompt, a, b in zip(parity_prompts, ref, outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, f"prompt of {len(prompt)} tokens diverges"
    # the ranks really split the model: each holds part of the heads
    assert tp_llm.engine.executor.model_config.num_heads == 9


def test_structured_outputs_match_one_process(llm, tp_llm):
    # Rank 0 samples with the grammar the driver compiled (sent with the request's first step).
    sp = SamplingParams(temperature=0, max_tokens=12,
                        structured_outputs=StructuredOutputs(regex="[0-9]{3}-[a-z]{4}"))
    a = llm.generate(["Codes:"], sp, use_tqdm=False)[0].outputs[0].text
    b = tp_llm.generate(["Codes:"], sp, use_tqdm=False)[0].outputs[0].text
    assert b == a and re.fullmatch("[0-9]{3}-[a-z]{4}", b)


def test_chunks_preemption_and_speculation_match_one_process(parity_prompts):
    # A small budget cuts prompts into chunks, a small cache forces preemption (recompute),
    # n-gram drafts make verify steps; prompt logprobs are gathered across the vocabulary shards.
    settings = dict(max_num_batched_tokens=64, num_kv_blocks=30, max_num_seqs=3,
                    speculative_config={"num_speculative_tokens": 3})
    prompts = parity_prompts[2:6]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    results = []
    for tp in (1, 2):
        llm = LLM(quant_activations="exact", tensor_parallel_size=tp, **settings)
        try:
            results.append((llm.generate(prompts, sp, use_tqdm=False), llm.engine.num_preemptions,
                            llm.engine.scheduler.num_drafts))
        finally:
            llm.close()
    (one, pre1, drafts1), (two, pre2, drafts2) = results
    assert pre2 > 0 and drafts2 > 0
    for a, b in zip(one, two):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


def _rank_pid(llm: LLM, rank: int) -> int:
    return llm.engine.executor.procs[rank].pid


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_dead_or_hung_rank_stops_the_engine_with_a_named_error(how):
    llm = LLM(quant_activations="exact", tensor_parallel_size=2, distributed_timeout_seconds=3)
    try:
        sp = SamplingParams(temperature=0, max_tokens=4)
        assert llm.generate("Hello", sp, use_tqdm=False)[0].outputs[0].token_ids
        pid = _rank_pid(llm, 1)
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ExecutorDead, match="rank"):
            llm.generate("Hello again", sp, use_tqdm=False)
        assert time.monotonic() - t0 < 25  # the collective's timeout (3 s), not the reply grace
        with pytest.raises(ExecutorDead):  # and it stays stopped
            llm.engine.executor.execute(None)  # type: ignore[arg-type]
    finally:
        llm.close()  # kills a stopped rank too
    assert not any(p.is_alive() for p in llm.engine.executor.procs)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def test_a_server_on_two_ranks_serves_then_reports_a_dead_rank():
    import httpx

    from tests.test_server import server

    with server("--tensor-parallel-size", "2") as proc:
        body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
        ok = httpx.post(proc.url + "/v1/completions", json=body, timeout=120)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
        ranks = [p for p in _children(proc.pid) if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()
                 and b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        bad = httpx.post(proc.url + "/v1/completions", json=body, timeout=120)
        assert bad.status_code == 500 and "tensor-parallel rank" in bad.json()["error"]["message"]
        health = httpx.get(proc.url + "/health", timeout=10)
        assert health.status_code == 503 and "rank" in health.json()["error"]["message"]
    assert not any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z" for p in ranks)


def test_an_images_pixels_reach_the_ranks_with_its_first_share_only():
    from ferry.core.multimodal import ImageFeature
    from ferry.core.outputs import SchedulerOutput
    from ferry.executor.tensor_parallel import without_sent_pixels

    a, b = ImageFeature(b"a", 3, 16, data={"pixel_values": 1}), ImageFeature(b"b", 20, 4, data={"pixel_values": 2})
    sent: set[bytes] = set()
    first = without_sent_pixels(SchedulerOutput(encoder_inputs=[("r", a, 5)]), sent)
    assert first.encoder_inputs[0][1].data is not None and sent == {b"a"}
    out = SchedulerOutput(encoder_inputs=[("r", a, 10), ("s", b, 4)])
    again = without_sent_pixels(out, sent)
    assert again.step_id == out.step_id and again.encoder_inputs[0][1].data is None
    assert again.encoder_inputs[0][1].hash == b"a" and again.encoder_inputs[1][1].data is not None
    # A freed image is sent whole again the next time it is encoded.
    without_sent_pixels(SchedulerOutput(freed_encoder_hashes=[b"a"]), sent)
    assert without_sent_pixels(SchedulerOutput(encoder_inputs=[("t", a, 5)]), sent).encoder_inputs[0][1].data
