"""Embeddings: an embedding request's prompt pooled into one vector (``SamplingParams.pooling``).

"last" takes the final normed hidden state of the prompt's last token (vLLM's default for decoder
models); "mean" averages it over every prompt token, chunk by chunk as the prompt is prefilled.
Either is L2-normalised, so a dot product of two embeddings is their cosine similarity.
"""
from __future__ import annotations

import torch

from ferry.executor.request_state import CachedRequest


def pool(rows: torch.Tensor, spans: list[tuple[CachedRequest, int, int, bool]]) -> dict[str, list[float]]:
    """The vectors of the requests whose prompt ends in this step (``spans`` as in PackedBatch)."""
    out: dict[str, list[float]] = {}
    row = 0
    for req, first, n, ends in spans:
        h = rows[row:row + n].float()
        row += n
        if req.sampling_params.pooling == "mean":
            if req.pool_sum is None:
                req.pool_sum = torch.zeros(h.shape[1])
            # Rows already added come again after a preemption or in a retried step: only new ones count.
            new = h[max(0, req.pool_upto - first):]
            req.pool_sum += new.sum(0).cpu()
            req.pool_upto = max(req.pool_upto, first + n)
            if not ends:
                continue
            v = req.pool_sum / req.pool_upto
        else:
            v = h[-1].cpu()
        out[req.request_id] = torch.nn.functional.normalize(v, dim=0).tolist()
    return out
