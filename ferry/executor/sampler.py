"""Turn logits into next tokens: penalties, greedy or random sampling, logprobs."""
from __future__ import annotations

import torch

from ferry.core.request import Request


def apply_penalties(logits: torch.Tensor, req: Request) -> None:
    """In place on one row: repetition (prompt and output), presence and frequency (output)."""
    sp = req.sampling_params
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if (sp.presence_penalty or sp.frequency_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long)
        counts = torch.zeros_like(logits).index_add_(0, out, torch.ones(len(out), dtype=logits.dtype))
        logits -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)


def _filter(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Zero out the tokens that top_k, top_p and min_p exclude (one row)."""
    if top_k and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs < kth, 0.0, probs)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        cum = sorted_p.cumsum(0)
        drop = (cum - sorted_p) > top_p * cum[-1]  # keep the smallest prefix reaching top_p
        probs = probs.clone()
        probs[idx[drop]] = 0.0
    if min_p > 0.0:
        probs = torch.where(probs < min_p * probs.max(), 0.0, probs)
    return probs


class Sampler:
    """Samples one token per row. Seeded requests get their own generator (reproducible)."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.request_generators.pop(rid, None)

    def _generator(self, req: Request) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self.generator
        g = self.request_generators.get(req.request_id)
        if g is None:
            g = self.request_generators[req.request_id] = torch.Generator().manual_seed(seed)
        return g

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], dict[str, dict[int, float]]]:
        """logits: [N, V] float32, one row per request. Returns tokens and requested logprobs."""
        raw = logits
        if any(r.sampling_params.has_penalties or r.num_output_tokens < r.sampling_params.min_tokens
               for r in reqs):
            logits = logits.clone()
            for i, r in enumerate(reqs):
                sp = r.sampling_params
                if sp.has_penalties:
                    apply_penalties(logits[i], r)
                if r.num_output_tokens < sp.min_tokens:
                    banned = list(sp.stop_token_ids) + ([r.eos_token_id] if r.eos_token_id is not None else [])
                    if banned:
                        logits[i, banned] = float("-inf")
        tokens = logits.argmax(dim=-1).tolist()
        for i, r in enumerate(reqs):
            sp = r.sampling_params
            if sp.greedy:
                continue
            probs = torch.softmax(logits[i] / sp.temperature, dim=-1)
            probs = _filter(probs, sp.top_k, sp.top_p, sp.min_p)
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one generator call per row.
            e = torch.empty_like(probs).exponential_(generator=self._generator(r))
            tokens[i] = int((probs / e).argmax())
        logprobs: dict[str, dict[int, float]] = {}
        for i, r in enumerate(reqs):
            n = r.sampling_params.logprobs
            if n is None:
                continue
            lp = torch.log_softmax(raw[i], dim=-1)
            entry = {tokens[i]: float(lp[tokens[i]])}
            if n:
                top = torch.topk(lp, n)
                entry.update(zip(top.indices.tolist(), top.values.tolist()))
            logprobs[r.request_id] = entry
        return tokens, logprobs
