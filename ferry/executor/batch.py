"""Pack one step's chunks into flat tensors: no padding between requests.

Decodes (one token with earlier context) come first so attention can take them
as one batch; prefill chunks follow. A speculative verify chunk (the last token
and its drafts) is packed as decode rows too, one per token, row j attending to
the context up to its own position: a verify step is then a decode step of more
rows (the fused C path included), and each row computes what a plain decode of
that token would. Everything is computed with numpy on whole
arrays, with one small Python loop over requests (never over tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ferry.core.outputs import ScheduledChunk
from ferry.executor.request_state import CachedRequest, RequestStates
from ferry.model.attention import AttentionMetadata, PrefillSpan


@dataclass
class PackedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # the sampling rows
    prompt_indices: torch.Tensor  # the prompt-logprob rows (their logits are made a block at a time)
    pool_indices: torch.Tensor  # the rows embedding requests pool
    # Requests that sample, in row order, each with its chunk (1 + len(spec_token_ids) rows).
    sampling: list[tuple[CachedRequest, ScheduledChunk]]
    # Requests that score prompt tokens: (request, index of the first token scored, how many).
    prompt_spans: list[tuple[CachedRequest, int, int]]
    # Embedding requests: (request, position of the first row pooled, how many, whether the prompt ends here).
    pool_spans: list[tuple[CachedRequest, int, int, bool]]
    # Recurrent-state slots (hybrid models): (source, destination) copies before the forward pass
    # (requests resuming from a snapshot) and after it (snapshots kept for the prefix cache).
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    images: Any = None  # image models: the step's ImageRows (``ferry.executor.images``), set after packing

    def to(self, device: torch.device) -> "PackedBatch":
        """The batch on ``device``: packed on the host, sent once per step (nothing on the CPU)."""
        if device.type == "cpu":
            return self
        return PackedBatch(self.input_ids.to(device, non_blocking=True), self.positions.to(device, non_blocking=True),
                           self.meta.to(device), self.logits_indices.to(device, non_blocking=True),
                           self.prompt_indices.to(device, non_blocking=True),
                           self.pool_indices.to(device, non_blocking=True), self.sampling, self.prompt_spans,
                           self.pool_spans, self.state_copies, self.snapshots)


def _slots(block_ids: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    table = np.asarray(block_ids, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


def _token_ids(r: CachedRequest, c: ScheduledChunk) -> list[int]:
    """A chunk's input tokens: known ones, then its drafts."""
    known = r.all_token_ids[c.start:c.start + c.num_tokens - len(c.spec_token_ids)]
    return known + c.spec_token_ids if c.spec_token_ids else known


def row_groups(chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
    """The chunks as their rows are packed: the decode chunks first (``ScheduledChunk.decode``: the
    attention runs them as one-token queries), then the prefill chunks."""
    return [c for c in chunks if c.decode], [c for c in chunks if not c.decode]


def pack(chunks: list[ScheduledChunk], states: RequestStates, block_size: int,
         state_copies: list[tuple[int, int]] | None = None) -> PackedBatch:
    decodes, prefills = row_groups(chunks)
    ordered = decodes + prefills
    reqs = {c.request_id: states[c.request_id] for c in chunks}

    ids: list[int] = []
    for c in ordered:
        ids.extend(_token_ids(reqs[c.request_id], c))
    slot_parts: list[np.ndarray] = []
    pos_parts: list[np.ndarray] = []

    nd = sum(c.num_tokens for c in decodes)  # decode rows
    decode_tables = decode_lens = None
    if nd:
        starts = np.concatenate([np.arange(c.start, c.start + c.num_tokens) for c in decodes]) \
            if nd > len(decodes) else np.fromiter((c.start for c in decodes), dtype=np.int64, count=nd)
        tables = [reqs[c.request_id].block_ids for c in decodes]
        table = np.zeros((len(decodes), max(map(len, tables))), dtype=np.int64)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        if nd > len(decodes):  # verify chunks: one row per token, each with its request's table
            table = np.repeat(table, [c.num_tokens for c in decodes], axis=0)
        decode_tables = torch.from_numpy(table)
        decode_lens = torch.from_numpy(starts + 1)
        slot_parts.append(table[np.arange(nd), starts // block_size] * block_size + starts % block_size)
        pos_parts.append(starts)

    spans: list[PrefillSpan] = []
    row = nd
    for c in prefills:
        block_ids = reqs[c.request_id].block_ids
        pos = np.arange(c.start, c.start + c.num_tokens)
        span = PrefillSpan(q_start=row, q_len=c.num_tokens, ctx_len=c.start, state_slot=c.state_slot)
        if c.start > 0:
            all_pos = np.arange(c.start + c.num_tokens)
            ctx_slots = _slots(block_ids, all_pos, block_size)
            slot_parts.append(ctx_slots[c.start:])
            span.ctx_slots = torch.from_numpy(ctx_slots)
        else:
            slot_parts.append(_slots(block_ids, pos, block_size))
        pos_parts.append(pos)
        spans.append(span)
        row += c.num_tokens

    sampling: list[tuple[CachedRequest, ScheduledChunk]] = []
    logit_rows: list[int] = []
    prompt_rows: list[int] = []
    prompt_spans: list[tuple[CachedRequest, int, int]] = []
    pool_rows: list[int] = []
    pool_spans: list[tuple[CachedRequest, int, int, bool]] = []
    row = 0
    for c in ordered:
        r = reqs[c.request_id]
        pooling = r.sampling_params.pooling
        if pooling is not None and not c.padding:
            ends = c.start + c.num_tokens >= r.num_prompt_tokens
            if pooling == "mean":
                pool_rows.extend(range(row, row + c.num_tokens))
                pool_spans.append((r, c.start, c.num_tokens, ends))
            elif ends:  # "last": the prompt's last row only
                pool_rows.append(row + c.num_tokens - 1)
                pool_spans.append((r, c.start + c.num_tokens - 1, 1, True))
        if r.sampling_params.prompt_logprobs is not None and not c.padding:
            # Position p's logits score prompt token p + 1.
            n = min(c.start + c.num_tokens, r.num_prompt_tokens - 1) - c.start
            if n > 0:
                prompt_rows.extend(range(row, row + n))
                prompt_spans.append((r, c.start + 1, n))
        row += c.num_tokens
        if c.samples and not c.padding:
            sampling.append((r, c))
            logit_rows.extend(range(row - c.num_sampling_rows, row))

    stateful = bool(chunks) and chunks[0].state_slot >= 0
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slot_parts)), num_decodes=nd,
        decode_block_tables=decode_tables, decode_lens=decode_lens, block_size=block_size, prefills=spans,
        max_decode_len=int(starts.max()) + 1 if nd else 0,
        decode_state_slots=torch.tensor([c.state_slot for c in decodes], dtype=torch.long) if stateful else None)
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.from_numpy(np.concatenate(pos_parts)),
        meta=meta, logits_indices=torch.tensor(logit_rows, dtype=torch.long),
        prompt_indices=torch.tensor(prompt_rows, dtype=torch.long), pool_indices=torch.tensor(pool_rows, dtype=torch.long),
        sampling=sampling, prompt_spans=prompt_spans, pool_spans=pool_spans, state_copies=list(state_copies or ()),
        snapshots=[(c.state_slot, c.snapshot_slot) for c in chunks if c.snapshot_slot >= 0] if stateful else [])
