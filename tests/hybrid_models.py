"""What the hybrid models' tests share (a test helper): a step driver that runs one part or the whole
decoder over a schedule of packed prefill chunks and decodes without the engine (attention metadata,
prefill spans, KV and state caches made here, as the engine's plumbing makes them), the comparisons
with transformers, and ferry.LLM set up to chunk, preempt and cache prefixes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ferry.model.attention import AttentionMetadata, PrefillSpan
from ferry.model.config import ModelConfig
from ferry.model.layers.context import StepContext

Run = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


@dataclass(frozen=True)
class Schedule:
    """Each request's tokens in ``steps``: ("p", request, n) a prefill chunk of n tokens, ("d", request)
    a one-token decode row (decode rows lead the packed batch, in the order given). Request r has
    ``lengths[r]`` tokens in all, state slot ``slots[r]`` and its KV positions in block ``slots[r]``
    of ``block`` slots."""

    steps: list[list[tuple]]
    lengths: list[int]
    slots: list[int]
    block: int = 64

    def batch(self, step: list[tuple], done: list[int]):
        """One step's rows: [(request, position)] in packed order, its prefill spans and decode slots."""
        rows, spans, decode_slots = [], [], []
        for _, r in (s for s in step if s[0] == "d"):
            rows.append((r, done[r]))
            decode_slots.append(self.slots[r])
        for _, r, n in (s for s in step if s[0] == "p"):
            spans.append(PrefillSpan(len(rows), n, done[r], state_slot=self.slots[r]))
            rows += [(r, done[r] + j) for j in range(n)]
        return rows, spans, decode_slots

    def metadata(self, rows, spans: list[PrefillSpan], decode_slots: list[int]) -> AttentionMetadata:
        """Request r's positions in KV block slots[r]."""
        nd = len(decode_slots)
        slot_of = lambda r, p: self.slots[r] * self.block + p  # noqa: E731
        for s in spans:
            r = rows[s.q_start][0]
            s.ctx_slots = torch.tensor([slot_of(r, p) for p in range(s.ctx_len + s.q_len)]) if s.ctx_len else None
        return AttentionMetadata(
            slot_mapping=torch.tensor([slot_of(r, p) for r, p in rows]), num_decodes=nd,
            decode_block_tables=torch.tensor([[self.slots[r]] for r, _ in rows[:nd]]) if nd else None,
            decode_lens=torch.tensor([p + 1 for _, p in rows[:nd]]) if nd else None, block_size=self.block,
            prefills=spans, max_decode_len=max((p + 1 for _, p in rows[:nd]), default=0),
            decode_state_slots=torch.tensor(decode_slots, dtype=torch.int64) if nd else None)

    def stepped(self, run: Run, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``run(packed inputs, positions, meta)`` over the steps; each request's outputs in token order."""
        done, outs = [0] * len(inputs), [[None] * len(x) for x in inputs]
        for step in self.steps:
            rows, spans, decode_slots = self.batch(step, done)
            y = run(torch.stack([inputs[r][p] for r, p in rows]), torch.tensor([p for _, p in rows]),
                    self.metadata(rows, spans, decode_slots))
            for i, (r, p) in enumerate(rows):
                outs[r][p] = y[i]
                done[r] = max(done[r], p + 1)
        assert done == self.lengths
        return [torch.stack(o) for o in outs]


# Three requests of 23, 30 and 12 tokens: prefill chunks of 1 to 14 tokens (ending at every offset of a
# short conv window, inside a Mamba2 conv window and across scan chunks of 8); decodes read state slots
# out of request order (slot 1 is never used, its garbage never read).
SHORT = Schedule(steps=[[("p", 0, 7), ("p", 1, 5)],
                        [("p", 0, 9), ("p", 1, 1), ("p", 2, 8)],
                        [("d", 0), ("d", 2), ("p", 1, 10)],
                        [("d", 2), ("d", 0), ("p", 1, 14)],
                        [("d", 0), ("d", 2)],
                        [("d", 2), ("p", 0, 4)]],
                 lengths=[23, 30, 12], slots=[2, 0, 3])
SHORT_PROMPTS = [[(7 * i + 3) % 300 + 2 for i in range(n)] for n in SHORT.lengths]


# ---------------------------------------------------------------- one part
def first_layer_part(cfg: ModelConfig, state: dict[str, torch.Tensor], kind: str, heads: tuple[int, int, int]):
    """Layer 0's ``kind`` part built from ``state`` (float32, one rank), as the decoder builds it."""
    from ferry.model.decoder import PartFacts
    from ferry.model.layers import PARTS
    from ferry.model.shard_plan import ShardPlan
    from ferry.model.weights import WeightTaker

    w = WeightTaker(cfg, state, ShardPlan.make(cfg, 0, 1), torch.float32, torch.device("cpu")).layer(0)
    return PARTS[kind](cfg.layers[0].recurrent, w, PartFacts(heads, lambda spec: 0))


def part_outputs(part, cfg: ModelConfig, use_kernel: bool, cache: dict[str, torch.Tensor],
                 inputs: list[torch.Tensor], schedule: Schedule) -> list[torch.Tensor]:
    """The part's outputs for each request's ``inputs``, stepped over ``schedule`` with state ``cache``."""
    def run(h, positions, meta):
        return part.forward(h, StepContext(positions, meta, use_kernel, cfg.rms_norm_eps, lambda _: None, []), cache)

    return schedule.stepped(run, inputs)


def assert_part_matches(hf_layer, inputs: list[torch.Tensor], got: list[torch.Tensor], rtol: float,
                        atol: float) -> None:
    """Each request's outputs equal the transformers layer's on its whole sequence."""
    with torch.inference_mode():
        for x, y in zip(inputs, got):
            torch.testing.assert_close(y, hf_layer(x[None])[0], rtol=rtol, atol=atol)


# ---------------------------------------------------------------- the whole decoder, stepped by hand
def decoder_logits(model_dir, weights, prompts: list[list[int]], schedule: Schedule, use_kernel: bool = True,
                   state: Callable[..., torch.Tensor] = torch.zeros, fused: bool = False) -> list[torch.Tensor]:
    """Every prompt position's logits from ferry's DecoderModel, driven over ``schedule`` with KV
    caches of zeros and state caches made by ``state`` (what the engine's plumbing does); without
    ``use_kernel`` decode-only steps skip the fused C decode. ``fused``: assert that its decode-only
    steps ran in the fused C decode."""
    from ferry.model.decoder import DecoderModel

    cfg = ModelConfig.from_dir(model_dir)
    model = DecoderModel(cfg, weights, torch.float32, 256)
    model.use_kernel = model.use_kernel and use_kernel
    runs = []
    if fused:
        assert model.fused is not None, "no fused C decode for this model"
        fused_run = model.fused.run
        model.fused.run = lambda *a, **k: runs.append(1) or fused_run(*a, **k)
    hkv, hd, kv_slots = cfg.num_kv_heads, cfg.head_dim, 4 * schedule.block
    caches = [{n: state(4, *s) for n, s in cfg.state_shapes(i).items()} if i in cfg.recurrent_layers
              else (torch.zeros(kv_slots, hkv, hd), torch.zeros(kv_slots, hkv, hd)) for i in range(cfg.num_layers)]

    def run(x, positions, meta):
        return model.forward(x, positions, meta, caches, torch.arange(x.shape[0])).logits

    out = schedule.stepped(run, [torch.tensor(p) for p in prompts])
    assert runs or not fused, "the decode-only steps did not run in the fused C decode"
    return out


def decoder_diff(model_dir, weights, model, prompts: list[list[int]], schedule: Schedule, **kw) -> float:
    """The largest |ferry - transformers| logprob of any vocabulary entry at any position of any
    prompt, ferry's from ``decoder_logits`` (``kw``: its options), transformers' ``model`` on each
    whole prompt."""
    worst = 0.0
    for logits, p in zip(decoder_logits(model_dir, weights, prompts, schedule, **kw), prompts):
        with torch.inference_mode():
            ref = model(torch.tensor([p])).logits[0]
        worst = max(worst, float((torch.log_softmax(logits, -1) - torch.log_softmax(ref, -1)).abs().max()))
    return worst


def rounded(model, qtype: str, quantized: Callable[[str, torch.Tensor], bool]):
    """A copy of ``model`` with every tensor the GGUF writer quantizes (``quantized(name, tensor)``)
    taken to ``qtype`` and back."""
    import copy

    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    out, kind = copy.deepcopy(model), GGMLQuantizationType[qtype]
    with torch.no_grad():
        for name, t in out.state_dict().items():
            if quantized(name, t):
                t.copy_(torch.from_numpy(dequantize(quantize(t.numpy(), kind), kind)).reshape(t.shape))
    return out


def skip_quantized_without_kernels(qtype: str) -> None:
    """Quantized weights are dequantized where no C kernels run: nothing of them to test there."""
    import pytest

    from ferry.model.kernels import kernels_usable

    if qtype != "F32" and not kernels_usable(torch.float32):
        pytest.skip("no C kernels here: quantized weights are dequantized")


def gguf_weights(gguf, converted_dir, quantization: str) -> dict:
    """The GGUF's tensors as the file holds them (quantization "gguf"), or its converted directory's
    ("none")."""
    from ferry.model.loader import load_safetensors
    from ferry.model.quant import load_gguf_weights

    return load_gguf_weights(gguf) if quantization == "gguf" else load_safetensors(converted_dir)


# ---------------------------------------------------------------- through the engine
E2E_PROMPTS = [[(7 * i + 3) % 300 + 2 for i in range(45)], [(11 * i + 5) % 300 + 2 for i in range(29)],
               [(7 * i + 3) % 300 + 2 for i in range(37)]]  # the third shares the first's first 37 tokens
NEW = 12


def engine(model: str, budget: int = 16, blocks: int = 26, **kw):
    """ferry.LLM on ``model`` with exact products and prefix caching: a 16-token budget cuts every
    prompt into chunks; 26 KV blocks of 4 tokens force preemption."""
    from ferry import LLM

    return LLM(model=model, quant_activations="exact", max_num_batched_tokens=budget, max_num_seqs=3, block_size=4,
               num_kv_blocks=blocks, enable_prefix_caching=True, **kw)


def engine_logprob_diff(llm, model, prompts: list[list[int]]) -> float:
    """The largest |ferry - transformers| prompt logprob over ``prompts``, in one generate call."""
    from ferry import SamplingParams
    from tests.arch_models import hf_logprobs

    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, prompt_logprobs=0)
    worst = 0.0
    for p, out in zip(prompts, llm.generate(prompts, sp, use_tqdm=False)):
        got = torch.tensor([out.prompt_logprobs[j][p[j]] for j in range(1, len(p))])
        worst = max(worst, float((got - hf_logprobs(model, p)).abs().max()))
    return worst


def hf_greedy_all(model, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' NEW greedy tokens after each prompt."""
    from tests.arch_models import hf_greedy

    return [hf_greedy(model, p, NEW) for p in prompts]


def greedy_matches(llm, model, prompts: list[list[int]], greedy: list[list[int]]) -> None:
    """In one generate call, greedy tokens equal ``greedy`` (transformers'), and each decode step's
    logprob transformers' logprob."""
    from ferry import SamplingParams
    from tests.arch_models import hf_logprobs

    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy
    for p, g, out in zip(prompts, greedy, outs):
        ref = hf_logprobs(model, p + g)[-NEW:]
        got = torch.tensor([out.outputs[0].logprobs[j][g[j]] for j in range(NEW)])
        assert float((got - ref).abs().max()) < 1e-4
