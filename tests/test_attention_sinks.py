"""Attention sinks (gpt-oss): each query head's learned logit joins every softmax denominator and
adds no value. The torch path and both C kernels (decode, chunked prefill with context, sliding
windows) equal a direct softmax over [scores, sink]; a sink of -inf is no sink; the declaration
names, loads and cuts the tensor; and a tiny Llama given sinks runs as transformers' gpt-oss eager
attention does, on every decode path (the fused C op list, the C kernels, torch)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ferry.model.attention import AttentionMetadata, PrefillSpan, paged_attention, prefill_attention_kernel
from ferry.model.kernels import load_kernels

HQ, HKV, D = 8, 2, 32  # grouped heads; D a multiple of every vector width, so the C kernels take it
SCALE = D ** -0.5
# (context, new tokens) per request: decodes first (one across the decode kernel's 256-slot ranges),
# then prefill chunks: a first chunk, chunks after a context, a one-token chunk.
DECODES = [(20, 1), (300, 1), (3, 1)]
PREFILLS = [(0, 37), (45, 20), (130, 1), (7, 9)]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, window: int | None,
              sinks: torch.Tensor | None) -> torch.Tensor:
    """One query [HQ, D] at position ``pos`` over the dense K/V [n, HKV, D] of its request, as
    transformers' gpt-oss eager attention: softmax over [scores, sink] less their max, sink dropped."""
    lo = 0 if window is None else max(0, pos - window + 1)
    kk = k[lo:pos + 1].repeat_interleave(HQ // HKV, dim=1)
    vv = v[lo:pos + 1].repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), kk.double()) * SCALE
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
    probs = torch.softmax(scores - scores.amax(dim=1, keepdim=True), dim=1)[:, :pos + 1 - lo]
    return torch.einsum("hl,lhd->hd", probs, vv.double()).float().reshape(-1)


def make_step(block_size: int, draw: int):
    """Every request's dense K/V, a cache holding their contexts in scattered blocks (NaN in every
    other slot: a stray read poisons the output), one step's q/k/v rows and metadata."""
    g = torch.Generator().manual_seed(draw)
    reqs = DECODES + PREFILLS
    lens = [c + n for c, n in reqs]
    need = [-(-n // block_size) for n in lens]
    blocks = torch.randperm(sum(need) + 5, generator=g).tolist()
    tables = [[blocks.pop() for _ in range(k)] for k in need]
    slots = [torch.tensor(t)[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
             for t, n in zip(tables, lens)]
    dense = [(torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)) for n in lens]
    n_slots = (sum(need) + 5) * block_size
    k_cache, v_cache = torch.full((n_slots, HKV, D), float("nan")), torch.full((n_slots, HKV, D), float("nan"))
    for (c, _), s, (k, v) in zip(reqs, slots, dense):
        k_cache[s[:c]], v_cache[s[:c]] = k[:c], v[:c]
    spans, row = [], len(DECODES)
    for (c, n), s in zip(PREFILLS, slots[len(DECODES):]):
        spans.append(PrefillSpan(row, n, c, s if c else None))
        row += n
    table = torch.zeros(len(DECODES), max(need), dtype=torch.long)
    for i, t in enumerate(tables[:len(DECODES)]):
        table[i, :len(t)] = torch.tensor(t)
    dec_lens = [c + 1 for c, _ in DECODES]
    meta = AttentionMetadata(
        slot_mapping=torch.cat([s[c:] for (c, _), s in zip(reqs, slots)]), num_decodes=len(DECODES),
        decode_block_tables=table, decode_lens=torch.tensor(dec_lens), block_size=block_size, prefills=spans,
        max_decode_len=max(dec_lens))
    q = torch.randn(row, HQ, D, generator=g)
    k_new = torch.cat([k[c:] for (c, _), (k, _) in zip(reqs, dense)])
    v_new = torch.cat([v[c:] for (c, _), (_, v) in zip(reqs, dense)])
    return q, k_new, v_new, k_cache, v_cache, meta, dense


def expected(q: torch.Tensor, dense: list, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """The reference output of every row of the step, in packed order."""
    out, row = [], 0
    for (c, n), (k, v) in zip(DECODES + PREFILLS, dense):
        for t in range(n):
            out.append(reference(q[row], k, v, c + t, window, sinks))
            row += 1
    return torch.stack(out)


def _path(name: str) -> bool:
    if name == "kernel" and load_kernels() is None:
        pytest.fail("the attention kernels could not be built (no C compiler?)")
    return name == "kernel"


def _sinks(draw: int) -> torch.Tensor:
    """Sink logits around the scores' size (some well above them), so each one's share is large."""
    return torch.randn(HQ, generator=torch.Generator().manual_seed(draw)) * 2.0 + 1.0


@pytest.mark.parametrize("path", ["torch", "kernel"])
@pytest.mark.parametrize("window", [None, 6, 50])
@pytest.mark.parametrize("block_size", [1, 16])
def test_sinks_join_every_softmax_denominator(path, window, block_size):
    """Decodes (one across ranges the decode kernel merges) and prefill chunks with and without
    context, in one step, each row equal to the direct softmax over [scores, sink]."""
    use_kernel = _path(path)
    q, k, v, k_cache, v_cache, meta, dense = make_step(block_size, draw=block_size + (window or 0))
    sinks = _sinks(window or 0)
    got = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, use_kernel=use_kernel, window=window, sinks=sinks)
    want = expected(q, dense, window, sinks)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The sinks matter here: the same rows without them are far off (a dropped sink fails above).
    assert (expected(q, dense, window, None) - want).abs().max() > 0.05
    if use_kernel:  # the prefill rows came from the C kernel, not torch's fallback
        out = torch.full_like(q, float("nan"))
        assert prefill_attention_kernel(q, k_cache, v_cache, meta, SCALE, window, out, sinks)
        rows = slice(len(DECODES), q.shape[0])
        torch.testing.assert_close(out[rows].reshape(-1, HQ * D), want[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["torch", "kernel"])
@pytest.mark.parametrize("window", [None, 6])
def test_a_sink_of_minus_infinity_is_no_sink(path, window):
    use_kernel = _path(path)
    q, k, v, k_cache, v_cache, meta, dense = make_step(4, draw=3)
    none = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, SCALE, use_kernel=use_kernel,
                           window=window)
    got = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, use_kernel=use_kernel, window=window,
                          sinks=torch.full((HQ,), float("-inf")))
    torch.testing.assert_close(got, none, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, expected(q, dense, window, None), rtol=1e-5, atol=1e-5)


def test_the_torch_path_bounds_its_scores_on_long_chunks(monkeypatch):
    """The explicit softmax goes through a long chunk's queries in groups (here of a few rows)."""
    import ferry.model.attention as A

    monkeypatch.setattr(A, "SINK_SCORES", HQ * 64 * 3)
    q, k, v, k_cache, v_cache, meta, dense = make_step(8, draw=5)
    sinks = _sinks(5)
    got = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, use_kernel=False, sinks=sinks)
    torch.testing.assert_close(got, expected(q, dense, None, sinks), rtol=1e-5, atol=1e-5)


# -- the declaration, its names and its tensor-parallel cut ------------------------------------------

CONFIG = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=500.0,
              tie_word_embeddings=False)


@pytest.fixture
def sink_llama():
    """A Llama whose every attention has sinks, registered for the test."""
    from ferry.model.arch import ARCHITECTURES, Architecture, register
    from ferry.model.arch.parts import llama_layers

    arch = register(Architecture("SinkLlamaForCausalLM", "sink_llama",
                                 configure=lambda d: {"layers": llama_layers(d, sinks=True)}))
    yield arch
    del ARCHITECTURES[arch.hf_name]


def test_sinks_are_declared_named_and_cut_per_query_head(sink_llama):
    from ferry.model.config import ModelConfig
    from ferry.model.gguf_convert import hf_name
    from ferry.model.shard_plan import ShardPlan
    from ferry.model.weights import WeightTaker, declared, dummy_weights

    cfg = ModelConfig.from_dict(dict(CONFIG, architectures=[sink_llama.hf_name]))
    names = {n: d for n, d in declared(cfg)}
    d = names["model.layers.1.self_attn.sinks"]
    assert (d.role, d.shape, d.cut) == ("sinks", (4,), "rows:heads")
    assert hf_name("blk.1.attn_sinks.weight", sink_llama) == "model.layers.1.self_attn.sinks"
    for rank in (0, 1):  # each rank holds its query heads' sinks
        weights = dummy_weights(cfg)
        full = weights["model.layers.1.self_attn.sinks"].clone()
        plan = ShardPlan.make(cfg, rank, 2)
        got = WeightTaker(cfg, weights, plan, torch.float32, torch.device("cpu")).layer(1)["sinks"]
        torch.testing.assert_close(got, full[plan.q_heads[0]:plan.q_heads[1]])


# -- a tiny Llama with sinks against transformers' gpt-oss eager attention ----------------------------

PROMPTS = [[5, 17, 42, 9, 88, 5, 61, 23, 3], [7, 7, 100, 2] * 6, list(range(50, 90))]
NEW = 10


@pytest.fixture
def sink_model(tmp_path, monkeypatch, sink_llama):
    """A random transformers Llama given random sinks, run with gpt-oss's eager attention function:
    (its directory for ferry, each prompt's full sequence of greedy tokens and their logprobs)."""
    from safetensors.torch import save_file
    import transformers.models.gpt_oss.modeling_gpt_oss as gpt_oss
    import transformers.models.llama.modeling_llama as llama

    from tests.arch_models import make_model

    model = make_model("llama-default", tmp_path)
    g = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        layer.self_attn.sinks = torch.nn.Parameter(torch.randn(4, generator=g) * 2.0 + 1.0)
    monkeypatch.setattr(llama, "eager_attention_forward", gpt_oss.eager_attention_forward)
    refs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([p])
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, pad_token_id=0)[0]
            refs.append((seq.tolist(), torch.log_softmax(model(seq[None]).logits[0].float(), -1)))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, architectures=[sink_llama.hf_name])))
    return tmp_path, refs


def _matches(outs: list, refs: list) -> None:
    """Greedy tokens equal transformers'; prompt and sampled logprobs within 1e-3 of its."""
    for p, out, (seq, ref) in zip(PROMPTS, outs, refs):
        toks = out.outputs[0].token_ids
        assert toks == seq[len(p):]
        lps = [out.prompt_logprobs[j][p[j]] for j in range(1, len(p))]
        lps += [lp[t] for lp, t in zip(out.outputs[0].logprobs, toks)]
        want = [float(ref[j - 1, seq[j]]) for j in range(1, len(seq))]
        assert max(abs(a - b) for a, b in zip(lps, want)) < 1e-3


def test_a_llama_with_sinks_runs_as_transformers_gpt_oss_attention_on_every_path(sink_model):
    """Chunked prompts (a 16-token budget: chunks after a context) and batched decodes, through
    the fused C decode (its attention op), the C kernels alone and the torch path."""
    from ferry import LLM, SamplingParams

    path, refs = sink_model
    if load_kernels() is None:
        pytest.fail("the kernels could not be built (no C compiler?)")
    llm = LLM(model=str(path), num_kv_blocks=64, max_num_batched_tokens=16, enable_prefix_caching=False)
    model = llm.engine.executor.model
    assert model.fused is not None and model.layers[0].blocks[0].part.sinks is not None
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    calls, run = [], model.fused.run
    model.fused.run = lambda *a, **k: (calls.append(1), run(*a, **k))[1]
    _matches(llm.generate(PROMPTS, sp, use_tqdm=False), refs)
    assert len(calls) >= NEW - 1  # decode steps went through the C op list
    model.fused = None
    _matches(llm.generate(PROMPTS, sp, use_tqdm=False), refs)
    model.use_kernel = False
    _matches(llm.generate(PROMPTS, sp, use_tqdm=False), refs)
