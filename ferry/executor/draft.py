"""Speculative decoding with a draft model: a smaller model of the same vocabulary proposes each
verify chunk's tokens, in the executor, just before the target verifies them.

The scheduler sizes a verify chunk (``1 + k`` tokens of its budget) and allocates its blocks with
placeholder drafts; ``DraftModel.propose`` then runs the draft over the same step and writes the
``k`` proposals into the chunks. The draft's KV lives in the target's blocks (vLLM's way): the
same block table, one more set of layers per block, the memory budget shared
(``bytes_per_block`` is added to the target's when the cache is sized). Its positions stay
consistent with three rules, all in ``_catch_up_from``:

* every chunk the target computes, the draft computes too (prefill chunks in the same step), so
  the draft has seen the whole prompt before it proposes;
* after a verify, the draft's valid length is cut back to what the target kept (rejected
  proposals' slots are simply overwritten later);
* a preempted or new request starts again from its chunk's start (a prefix-cache hit's blocks
  were computed by both models; a preempted request's new blocks are recomputed by both).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ferry.config import EngineConfig
from ferry.core.outputs import ScheduledChunk, SchedulerOutput
from ferry.core.sampling_params import SamplingParams
from ferry.executor.batch import pack
from ferry.executor.kv_tensors import allocate, block_bytes, kv_groups
from ferry.executor.request_state import RequestStates
from ferry.executor.sampler import draft_token
from ferry.model.config import ModelConfig
from ferry.model.decoder import DecoderModel
from ferry.model.kv_format import cache_dtype
from ferry.model.loader import DTYPES, load_weights
from ferry.model.quant import uses_q8

# A verify chunk's catch-up of at most this many tokens runs as decode rows (usually 1 or 2 tokens).
CATCH_UP_DECODE_ROWS = 8
_PLAIN = SamplingParams()  # what the packer reads of a draft row: no pooling, no prompt logprobs


class _DraftView:
    """A request as the draft's packer sees it: its known tokens plus the proposals so far."""

    __slots__ = ("request_id", "all_token_ids", "block_ids")
    sampling_params = _PLAIN
    num_prompt_tokens = 0

    def __init__(self, request_id: str, all_token_ids: list[int], block_ids: list[int]) -> None:
        self.request_id, self.all_token_ids, self.block_ids = request_id, all_token_ids, block_ids


def _vocab(tokenizer: Any) -> dict[str, int] | None:
    fast = getattr(tokenizer, "_fast", None)
    return fast.get_vocab(with_added_tokens=True) if fast is not None else None


def check_same_vocab(target: ModelConfig, draft: ModelConfig, target_tok: Any, draft_tok: Any,
                     draft_name: str) -> None:
    """Raise ValueError unless the draft model speaks the target's token ids."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"speculative_config.model {draft_name!r} has a vocabulary of {draft.vocab_size} "
                         f"tokens, the target {target.vocab_size}: a draft model needs the target's tokenizer")
    a, b = _vocab(target_tok), _vocab(draft_tok)
    if a is not None and b is not None and a != b:
        diff = len(set(a.items()) ^ set(b.items()))
        raise ValueError(f"speculative_config.model {draft_name!r} has another tokenizer than the target "
                         f"({diff} token entries differ): a draft model needs the target's tokenizer")


def refuse_assistant(model: str) -> None:
    """Raise a clear ValueError for a Gemma 4 assistant drafter (transformers' gemma4_assistant): it
    attends to the target's own K/V of its last layers (``shared_kv_states``) and reads the target's
    hidden state, so it is no stand-alone draft model: ferry runs it as method "mtp"."""
    import json
    from pathlib import Path

    config = Path(model).expanduser() / "config.json"
    try:
        d = json.loads(config.read_text()) if config.is_file() else {}
    except ValueError:
        return
    assistants = {"Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM"}
    if assistants & set(d.get("architectures") or []) or d.get("model_type") in ("gemma4_assistant",
                                                                                 "gemma4_unified_assistant"):
        raise ValueError(f"speculative_config.model {model!r} is a Gemma 4 assistant drafter, no stand-alone draft "
                         "model: it reads the target's hidden states and attends to the target's own K/V "
                         "(shared_kv_states); give it with method 'mtp' (a Gemma 4 target)")


class DraftModel:
    """The draft model, its KV layers over the target's blocks, and each request's draft length."""

    def __init__(self, config: EngineConfig, target: ModelConfig, target_tokenizer: Any,
                 max_model_len: int, device: torch.device, seed: int = 0) -> None:
        # Imported here: model_executor imports this module.
        from ferry.executor.model_executor import ModelSetup

        spec = config.speculative_config
        assert spec is not None and spec.model is not None
        # The draft's own quantization: a GGUF draft stays quantized beside a float target.
        draft_config = replace(config, model=spec.model, quantization=None, max_model_len=None,
                               speculative_config=None)
        refuse_assistant(spec.model)
        try:
            setup = ModelSetup.resolve(draft_config)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"speculative_config.model: {e}") from None
        cfg = setup.model_config
        check_same_vocab(target, cfg, target_tokenizer, setup.tokenizer, spec.model)
        if target.recurrent_layers:
            raise ValueError("speculative_config.model: this model has recurrent layers, whose state cannot be "
                             "rewound past a rejected draft token; serve it without a draft model")
        if cfg.recurrent_layers:
            raise ValueError(f"speculative_config.model {spec.model!r} has recurrent layers: a draft model's "
                             "state must rewind past rejected tokens, so it needs attention layers only")
        shapes = {cfg.kv_heads(i) for i in cfg.attention_layers}
        if cfg.kv_cache_layers != cfg.attention_layers or shapes - {(cfg.num_kv_heads, cfg.head_dim)}:
            raise ValueError(f"speculative_config.model {spec.model!r}: a draft model needs every attention "
                             "layer to keep K/V of the model's one shape (no shared or per-layer caches)")
        if cfg.max_window is not None or target.max_window is not None:
            raise ValueError("speculative_config.model: models whose every layer has a sliding window give "
                             "their blocks back as the window passes; a draft model needs full attention")
        if cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model {spec.model!r} reaches {cfg.max_position_embeddings} "
                             f"positions, fewer than max_model_len ({max_model_len}): lower max_model_len")
        dtype = DTYPES[setup.dtype_name]
        weights = load_weights(setup.config, cfg, setup.model_dir)
        q8 = uses_q8(weights)
        self.model = DecoderModel(cfg, weights, dtype, max_model_len, device)
        del weights
        self.cfg = cfg
        self.device = device
        self.kv_dtype = cache_dtype(config.kv_cache_dtype, dtype, q8)
        self.groups = kv_groups(cfg)  # one group: the checks above
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = config.block_size
        # Per request: how many leading positions of the draft's KV hold the request's true tokens.
        self.lens: dict[str, int] = {}
        self.generator = torch.Generator(device).manual_seed(seed + 1)

    def bytes_per_block(self, block_size: int) -> int:
        """What one KV block costs the draft (added to the target's when the cache is sized)."""
        return block_bytes(self.groups, block_size, self.kv_dtype)

    def allocate(self, num_blocks: int, zeros: Any) -> None:
        """The draft's KV layers over the target's ``num_blocks`` blocks (``zeros(shape, dtype)``)."""
        self.kv_caches = allocate(self.cfg.num_layers, self.groups, num_blocks * self.block_size, self.kv_dtype, zeros)

    # ------------------------------------------------------------------ one step
    def forget(self, out: SchedulerOutput) -> None:
        """Drop the step's finished and preempted requests (a preempted one's blocks are new: both
        models recompute them). Once per step: ``propose`` calls it."""
        for rid in list(out.finished_req_ids) + list(out.preempted_req_ids):
            self.lens.pop(rid, None)

    def propose(self, out: SchedulerOutput, states: RequestStates) -> dict[str, torch.Tensor]:
        """Run the draft over the step: catch up with every chunk's known tokens, then propose each
        verify chunk's drafts (written into ``chunk.spec_token_ids``). Returns, for requests that
        sample at a temperature, the draft's distributions ``[k, vocab]`` the proposals were drawn
        from (the verifier's ``q``); greedy requests get the draft's argmax chain."""
        self.forget(out)
        if not any(c.spec_token_ids for c in out.chunks):
            # No verify in this step (adaptive_k chose none): the draft catches up later, from where
            # it stopped (a request it has not seen, from its first chunk's start).
            for c in out.chunks:
                self.lens.setdefault(c.request_id, c.start)
            return {}
        first: list[ScheduledChunk] = []
        views: dict[str, _DraftView] = {}
        verifying: list[tuple[ScheduledChunk, _DraftView]] = []
        for c in out.chunks:
            r = states[c.request_id]
            if c.padding or r.sampling_params.pooling is not None:
                continue
            known_end = c.start + c.num_tokens - len(c.spec_token_ids)
            start = self._catch_up_from(c)
            view = _DraftView(c.request_id, r.all_token_ids[:known_end], r.block_ids)
            views[c.request_id] = view
            first.append(self._catch_up(c, view, start, known_end))
            self.lens[c.request_id] = known_end
            if c.spec_token_ids:
                verifying.append((c, view))
        if not first:
            return {}
        proposals: dict[str, list[int]] = {c.request_id: [] for c, _ in verifying}
        dists: dict[str, list[torch.Tensor]] = {}
        sp_of = {c.request_id: states[c.request_id].sampling_params for c, _ in verifying}
        chunks, j = first, 0
        while True:
            rows = self._run(chunks, views)
            for rid, logits in rows:
                token = self._choose(logits, sp_of[rid], dists.setdefault(rid, []))
                proposals[rid].append(token)
                views[rid].all_token_ids.append(token)
            j += 1
            chunks = [ScheduledChunk(c.request_id, c.start + j, 1, [], True)
                      for c, _ in verifying if len(c.spec_token_ids) > j]
            if not chunks:
                break
        for c, _ in verifying:
            k = len(c.spec_token_ids)
            c.spec_token_ids[:] = proposals[c.request_id]
            # Proposals 1..k-1 were written at the positions after the known tokens.
            self.lens[c.request_id] += k - 1
        return {rid: torch.stack(d) for rid, d in dists.items() if d}

    def _catch_up_from(self, c: ScheduledChunk) -> int:
        """Where the draft starts computing ``c``'s request: its valid length, cut back to what the
        target holds (rejected proposals, preemption); a request it has not seen trusts the
        chunk's start (prefix-cache blocks are computed by both models)."""
        known = self.lens.get(c.request_id)
        return c.start if known is None else min(known, c.start)

    @staticmethod
    def _catch_up(c: ScheduledChunk, view: _DraftView, start: int, end: int) -> ScheduledChunk:
        """The draft's chunk over positions ``start..end``. A verify chunk's catch-up (its last token,
        and the last accepted one) is packed as decode rows, the tokens after the first standing as
        its "drafts": a draft step of decode rows only takes the model's fused decode path."""
        if not c.spec_token_ids:
            return ScheduledChunk(c.request_id, start, end - start, [], False)
        if 0 < start and end - start <= CATCH_UP_DECODE_ROWS:
            return ScheduledChunk(c.request_id, start, end - start, view.all_token_ids[start + 1:end], True)
        return ScheduledChunk(c.request_id, start, end - start, [], True)

    def _run(self, chunks: list[ScheduledChunk], views: dict[str, _DraftView]
             ) -> list[tuple[str, torch.Tensor]]:
        """One forward pass of the draft over ``chunks``; each sampling chunk's last row's logits."""
        batch = pack(chunks, views, self.block_size).to(self.device)  # type: ignore[arg-type]
        logits = self.model.forward(batch.input_ids, batch.positions, batch.meta, self.kv_caches,
                                    batch.logits_indices).logits
        rows, row = [], -1
        for r, c in batch.sampling:
            row += c.num_sampling_rows
            rows.append((r.request_id, logits[row]))
        return rows

    def _choose(self, logits: torch.Tensor, sp: SamplingParams, dists: list[torch.Tensor]) -> int:
        """The draft's next token (``ferry.executor.sampler.draft_token``)."""
        return draft_token(logits, sp, dists, self.generator)
