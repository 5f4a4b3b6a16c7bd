"""Turn logits into next tokens: penalties, greedy or random sampling, logprobs, and the
verification of speculative drafts."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from ferry.core.outputs import ScheduledChunk
from ferry.core.sampling_params import SamplingParams
from ferry.executor.request_state import CachedRequest
from ferry.executor.structured import GrammarCompiler, RequestGrammar

# Grammar matchers kept: past this the least recently used goes, and is rebuilt by replaying its
# request's output if that request comes back, so a request never reported finished cannot leak.
MAX_GRAMMARS = 1024


def apply_penalties(logits: torch.Tensor, req: CachedRequest) -> None:
    """In place on one row: repetition (prompt and output), presence and frequency (output)."""
    sp = req.sampling_params
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if (sp.presence_penalty or sp.frequency_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.zeros_like(logits).index_add_(0, out, torch.ones(len(out), dtype=logits.dtype,
                                                                        device=logits.device))
        logits -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first maximum; a NaN counts as the maximum, as in torch). On the CPU
    through numpy, one thread: torch's argmax wakes its pool, 0.14 ms for one 49k-vocabulary row
    and 3.6 ms for 16 against numpy's 0.01 and 0.19 (measured)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


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


def sampling_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from (one row): softmax at its temperature, then
    its top_k, top_p and min_p filters (not renormalised)."""
    return _filter(torch.softmax(logits / sp.temperature, dim=-1), sp.top_k, sp.top_p, sp.min_p)


class Sampler:
    """Samples one token per row, and accepts or rejects draft tokens.

    A seeded request's draw for its k-th output token comes from a generator seeded with
    (seed, k) alone: the same tokens however its steps are batched, retried, preempted or
    speculated.

    Verification: a request with drafts d_1..d_k has k + 1 rows, row j giving the target's
    distribution p_j after d_1..d_j. Each row draws its token t_j from p_j exactly as without
    speculation (the same noise for the same output index); drafts are accepted while
    t_j == d_{j+1}, and the first t_j that differs (or t_k when all are accepted) ends the step.
    This is rejection sampling for a deterministic drafter: d is accepted with probability
    p(d) = min(1, p(d) / q(d)) for q a point mass on d, and on rejection the token is drawn
    from p restricted to tokens other than d, i.e. the normalised residual max(p - q, 0). So
    every output token is distributed exactly as the target's, greedy outputs are the
    target's argmax chain, and a seeded request gives the same tokens with speculation on
    or off.
    """

    def __init__(self, seed: int = 0, grammars: GrammarCompiler | None = None,
                 device: torch.device | str = "cpu") -> None:
        # On the logits' device: the draws happen where the logits are, only token ids come back.
        self.generator = torch.Generator(device).manual_seed(seed)
        self._seeded = torch.Generator(device)
        self.grammars = grammars
        # request id -> (the request, its matcher); the request too, so a reused id starts afresh.
        self._matchers: OrderedDict[str, tuple[CachedRequest, RequestGrammar]] = OrderedDict()

    def forget(self, request_ids: list[str]) -> None:
        """Drop per-request state (grammar matchers) of finished or aborted requests."""
        if self.grammars is not None:
            self.grammars.release(request_ids)
        if self._matchers:
            for rid in request_ids:
                self._matchers.pop(rid, None)

    def _matcher(self, req: CachedRequest) -> RequestGrammar:
        entry = self._matchers.get(req.request_id)
        if entry is not None and entry[0] is req:
            self._matchers.move_to_end(req.request_id)
            return entry[1]
        if self.grammars is None:
            raise ValueError("structured_outputs are not supported by this executor")
        g = self.grammars.new_request(req.sampling_params.structured_outputs, req.request_id)
        self._matchers[req.request_id] = (req, g)
        while len(self._matchers) > MAX_GRAMMARS:
            self._matchers.popitem(last=False)
        return g

    def _apply_grammars(self, logits: torch.Tensor, raw: torch.Tensor, reqs: list[CachedRequest],
                        rows: list[int]) -> list[RequestGrammar]:
        """Mask each structured row to the tokens its grammar allows next (greedy rows too)."""
        matchers = []
        for i in rows:
            r = reqs[i]
            g = self._matcher(r)
            # The grammar's mask is made on the host: a GPU row makes a round trip (grammar rows only).
            on_host = logits.device.type == "cpu"
            row = logits[i] if on_host else logits[i].cpu()
            g.mask(row, r.output_token_ids)
            # min_tokens may have banned the stop token that is all the grammar allows: the grammar
            # wins, or nothing would be left to sample.
            if r.num_output_tokens < r.sampling_params.min_tokens and not torch.isfinite(row).any():
                row.copy_(raw[i])
                g.mask(row, r.output_token_ids)
            if not on_host:
                logits[i] = row.to(logits.device)
            matchers.append(g)
        return matchers

    def _generator(self, req: CachedRequest, index: int) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self.generator
        # A 64-bit mix of (seed, token index): distinct streams for each token of each seed.
        return self._seeded.manual_seed((seed * 0x9E3779B97F4A7C15 + index) % 2**64)

    def sample(self, logits: torch.Tensor, sampling: list[tuple[CachedRequest, ScheduledChunk]],
               draft_dists: dict[str, torch.Tensor] | None = None
               ) -> tuple[dict[str, list[int]], dict[str, list[dict[int, float]]]]:
        """logits: [N, V] float32, ``chunk.num_sampling_rows`` rows per request in order.
        ``draft_dists``: per request whose drafts a draft model sampled, the distributions
        ``[k, V]`` they were drawn from; those requests are verified by ``rejection_sample``.
        Returns each request's new tokens (accepted drafts, then one more) and their logprobs."""
        raw = logits
        draft_dists = draft_dists or {}
        reqs: list[CachedRequest] = []  # per row
        index: list[int] = []  # per row: the output token index it draws
        for r, c in sampling:
            for j in range(c.num_sampling_rows):
                reqs.append(r)
                index.append(r.num_output_tokens + j)
        # Penalties and grammars depend on every earlier token: the scheduler drafts for neither,
        # so their requests have one row here.
        guided = [i for i, r in enumerate(reqs) if r.sampling_params.structured_outputs is not None]
        matchers: list[RequestGrammar] = []
        if guided or any(r.sampling_params.has_penalties or r.sampling_params.logit_bias
                         or k < r.sampling_params.min_tokens for r, k in zip(reqs, index)):
            logits = logits.clone()
            for i, (r, k) in enumerate(zip(reqs, index)):
                sp = r.sampling_params
                if sp.has_penalties:
                    apply_penalties(logits[i], r)
                if sp.logit_bias:
                    ids = torch.tensor(list(sp.logit_bias), dtype=torch.long, device=logits.device)
                    logits[i, ids] += torch.tensor(list(sp.logit_bias.values()), dtype=logits.dtype,
                                                   device=logits.device)
                if k < sp.min_tokens:
                    banned = list(sp.stop_token_ids) + list(r.eos_token_ids)
                    if banned:
                        logits[i, banned] = float("-inf")
            if guided:
                matchers = self._apply_grammars(logits, raw, reqs, guided)
        tokens = greedy_tokens(logits)
        for i, (r, k) in enumerate(zip(reqs, index)):
            sp = r.sampling_params
            if sp.greedy or r.request_id in draft_dists:
                continue
            probs = sampling_probs(logits[i], sp)
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one generator call per row.
            e = torch.empty_like(probs).exponential_(generator=self._generator(r, k))
            tokens[i] = int((probs / e).argmax())
        for i, g in zip(guided, matchers):
            g.advance(tokens[i])
        new: dict[str, list[int]] = {}
        logprobs: dict[str, list[dict[int, float]]] = {}
        row = 0
        for r, c in sampling:
            q = draft_dists.get(r.request_id)
            if q is not None and c.spec_token_ids:
                sp = r.sampling_params
                p = torch.stack([sampling_probs(logits[row + j], sp) for j in range(c.num_sampling_rows)])
                accepted = rejection_sample(p / p.sum(-1, keepdim=True), q.to(p.device), c.spec_token_ids,
                                            self._generator(r, r.num_output_tokens))
            else:
                accepted = verify(c.spec_token_ids, tokens[row:row + c.num_sampling_rows])
            new[r.request_id] = accepted
            n = r.sampling_params.logprobs
            if n is not None:
                entries = []
                for j, t in enumerate(accepted):
                    lp = torch.log_softmax(raw[row + j], dim=-1)
                    entry = {t: float(lp[t])}
                    if n:
                        top = torch.topk(lp, n)
                        entry.update(zip(top.indices.tolist(), top.values.tolist()))
                    entries.append(entry)
                logprobs[r.request_id] = entries
            row += c.num_sampling_rows
        return new, logprobs


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator: torch.Generator
                     ) -> list[int]:
    """Verify drafts drawn from distributions ``q`` ([k, V]) against the target's ``p`` ([k + 1, V],
    rows normalised): draft j is accepted with probability min(1, p_j(d) / q_j(d)); the first
    rejected one is replaced by a draw from the normalised max(0, p_j - q_j), and when all are
    accepted one more token is drawn from p_k. Each output token is then distributed as the
    target's (Leviathan et al., 2023), whatever q is."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * float(q[j, d]) < float(p[j, d]):
            out.append(d)
            continue
        residual = (p[j] - q[j]).clamp_min(0.0)
        total = float(residual.sum())
        # p == q leaves no residual; then nothing was ever rejected in exact arithmetic: draw from p.
        residual = residual / total if total > 0 else p[j]
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    return out


def verify(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verify step yields: ``sampled[j]`` is the target's token after the first j
    drafts; keep drafts while the target agrees, then the target's own next token."""
    for j, d in enumerate(drafts):
        if sampled[j] != d:
            return sampled[:j + 1]
    return sampled[:len(drafts) + 1]


# Prompt rows scored at once: a log-softmax is never materialised for more than this many rows
# (a 2,048-token chunk would be 2,048 x vocab floats again, on top of its logits).
PROMPT_LOGPROB_BLOCK = 64


def prompt_logprobs(rows: torch.Tensor, spans: list[tuple[CachedRequest, int, int]],
                    project: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> dict[str, tuple[int, list[dict[int, float]]]]:
    """Logprobs of prompt tokens from the rows that precede them (``spans`` as in PackedBatch):
    each token's own logprob plus the top ``prompt_logprobs`` alternatives. ``rows`` are logits,
    or hidden states that ``project`` turns into logits. Computed ``PROMPT_LOGPROB_BLOCK`` rows at
    a time as logit - logsumexp(row): only the rows' own and top-k values are kept, never the
    logits of the whole chunk."""
    out: dict[str, tuple[int, list[dict[int, float]]]] = {}
    row = 0
    for req, first, n in spans:
        ids = req.prompt_token_ids[first:first + n]
        targets = torch.tensor(ids, dtype=torch.long, device=rows.device)
        k = req.sampling_params.prompt_logprobs
        entries: list[dict[int, float]] = []
        for lo in range(0, n, PROMPT_LOGPROB_BLOCK):
            block = rows[row + lo:row + min(n, lo + PROMPT_LOGPROB_BLOCK)]
            block = (block if project is None else project(block)).float()
            lse = torch.logsumexp(block, dim=-1, keepdim=True)
            tids = targets[lo:lo + block.shape[0]]
            own = (block.gather(1, tids[:, None]) - lse)[:, 0].tolist()
            top = block.topk(k, dim=-1) if k else None
            top_ids = top.indices.tolist() if top is not None else None
            top_vals = (top.values - lse).tolist() if top is not None else None
            for i, (tid, v) in enumerate(zip(ids[lo:lo + block.shape[0]], own)):
                entry = {tid: v}
                if top_ids is not None:
                    entry.update(zip(top_ids[i], top_vals[i]))
                entries.append(entry)
        out[req.request_id] = (first, entries)
        row += n
    return out


def draft_token(logits: torch.Tensor, sp: SamplingParams, dists: list[torch.Tensor], generator: torch.Generator) -> int:
    """A drafter's next token: argmax for a greedy request, else a draw from the drafter's own
    distribution under the request's temperature and filters (appended to ``dists``, which the
    verify's rejection sampling reads)."""
    if sp.greedy:
        return greedy_tokens(logits[None])[0]
    probs = sampling_probs(logits.float(), sp)
    probs = probs / probs.sum()
    dists.append(probs)
    return int(torch.multinomial(probs, 1, generator=generator))
