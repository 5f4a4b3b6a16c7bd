"""The continuous-batching scheduler: who boards this step, and how many tokens each.

Each step has a token budget (``max_num_batched_tokens``). Running requests
board first, each taking ``min(need, remaining budget)``; that one ``min`` is all
of chunked prefill. Then waiting requests board with whatever budget is left.
When the KV cache runs out of blocks, the last-arrived running request is
preempted (recompute: its blocks go back and its progress resets to 0), and no
new request boards in that step.

Prefix caching and speculative decoding are the same counter moving differently:
a request boards with ``num_computed_tokens`` already past its longest cached
prefix, and a decoding request with drafts boards with ``1 + k`` tokens, of which
only the accepted ones stay computed.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from ferry.config import EngineConfig
from ferry.core.admission import resolve_max_tokens
from ferry.core.kv_cache_manager import KVCacheManager, blocks_for
from ferry.core.ngram import propose_ngram
from ferry.core.outputs import ModelRunnerOutput, NewRequest, ScheduledChunk, SchedulerOutput
from ferry.core.queues import make_queue, priority_key
from ferry.core.request import Request, RequestStatus
from ferry.core.spec_k import AcceptanceTracker
from ferry.core.stats import SchedulerState, SchedulerStats


class _EncoderStep:
    """One step's vision-encoder budget: image tokens' worth of encoding left, and how far the
    step's encoder work takes each image it touches (by hash)."""

    __slots__ = ("left", "upto", "overrun", "dropped")

    def __init__(self, budget: int) -> None:
        self.left = budget
        self.upto: dict[bytes, int] = {}
        self.overrun = False  # a chunk of this step took a whole image past its token budget
        self.dropped = False  # a preemption in this step dropped encoder work planned earlier in it


class Scheduler:
    """Continuous (iteration-level) batching with a token budget."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, clock: Callable[[], float],
                 whole_images: bool = False, choose_ks: Callable[..., list[int]] | None = None) -> None:
        """``whole_images``: the model attends each image's tokens both ways in prefill, so a chunk
        holds every image it touches whole (``Executor.whole_images``). ``choose_ks``: the draft-length
        choice of ``speculative_config.adaptive_k`` (``ferry.engine.draft_lengths.choose_ks``)."""
        assert config.max_model_len is not None
        self.config = config
        self.kv = kv
        self.clock = clock
        self.budget = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.waiting = make_queue(config.scheduling_policy, config.priority_aging_rate)
        # The most tokens one prefill chunk may take.
        self.chunk_cap = config.long_prefill_token_threshold or config.max_num_batched_tokens
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.spec = config.speculative_config
        # adaptive_k: each request's measured acceptance, and this step's draft lengths by request.
        self.acceptance = AcceptanceTracker() if self.spec is not None and self.spec.adaptive_k else None
        if self.acceptance is not None and choose_ks is None:
            raise ValueError("speculative_config.adaptive_k needs a draft-length choice (choose_ks)")
        self.choose_ks = choose_ks
        self._ks: dict[str, int] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_drafts = 0  # verify steps with drafts, summed over requests
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._stats = SchedulerStats()  # what the step in progress did, for take_stats
        self._finished_since_last_step: list[str] = []
        self._in_flight: dict[str, Request] = {}  # the requests of the step being run
        # Images: the vision encoder's budget per step (image tokens' worth of encoding: an image
        # of n tokens takes n, over as many steps as it needs), the requests that will still read
        # each encoder output the executor holds or is making (by image hash), how far each of
        # those is encoded (n: done), and the (hash, request) references that end once the step
        # in flight is over.
        self.encoder_budget = config.max_num_encoder_tokens or config.max_num_batched_tokens
        self.encoder_refs: dict[bytes, set[str]] = {}
        self.encoded: dict[bytes, int] = {}
        self._encoder_releases: list[tuple[bytes, str]] = []
        self._unread: list[bytes] = []  # freed encoder outputs the executor has not been told of
        self._enc = _EncoderStep(self.encoder_budget)
        self.whole_images = whole_images
        self._seq = 0

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, req: Request) -> None:
        """Queue ``req``, admitted already (``ferry.core.admission``: it fits max_model_len and the
        cache). Raises ValueError only for a request id in use."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.max_tokens = resolve_max_tokens(req.sampling_params, req.num_prompt_tokens, self.max_model_len)
        req.seq = self._seq
        self._seq += 1
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def abort_request(self, request_id: str) -> None:
        """Stop ``request_id`` now and give its blocks back. Unknown ids raise KeyError."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"cannot abort request {request_id!r}: no such unfinished request")
        self.finish_request(req, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """End ``req`` with ``status`` (the one way out: stops, errors, aborts) and free its blocks."""
        if stop_reason is not None:
            req.stop_reason = stop_reason
        if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
        req.status = status
        req.times.finished = self.clock()
        self.kv.free(req)
        if req.images:
            self._drop_images(req)
        del self.requests[req.request_id]
        if self.acceptance is not None:
            self.acceptance.forget(req.request_id)
        self._finished_since_last_step.append(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def state(self) -> SchedulerState:
        """The load right now (between steps too: requests come and go, aborts free blocks)."""
        used = self.kv.pool.num_used
        return SchedulerState(len(self.running), len(self.waiting), used, self.kv.num_blocks, self.num_preemptions)

    def take_stats(self) -> SchedulerStats:
        """What the scheduler did since the last call: once per step, after ``update_from_output``."""
        stats, self._stats = self._stats, SchedulerStats()
        return stats

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Decide this step's boarding list."""
        self.num_steps += 1
        budget = self.budget
        out = SchedulerOutput(finished_req_ids=self._take_finished())
        self._start_encoder_step()
        scheduled: dict[str, int] = {}

        # First priority: keep the running requests moving.
        # (Locals: this loop runs for every running request every step.)
        running, spec, allocate, chunk_cap = RequestStatus.RUNNING, self.spec, self.kv.allocate_slots, self.chunk_cap
        states = self.kv.states
        if self.acceptance is not None:
            self._ks = self._choose_ks(budget)
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not running:
                continue  # preempted earlier in this loop
            need = len(req.all_token_ids) - req.num_computed_tokens
            num = 1 if need == 1 else min(need, budget, chunk_cap)
            if states is not None:
                num = self.kv.cut(req, req.num_computed_tokens, num)
            todo: list[tuple[int, int]] = []
            if req.images and req.num_computed_tokens < req.num_prompt_tokens:
                num, todo = self._plan_images(req, req.num_computed_tokens, num)
                if num <= 0:  # its next image is being encoded (or waits for the encoder budget)
                    self._commit_images(req, req.num_computed_tokens, 0, todo, out)
                    continue
            if spec is not None:
                req.spec_token_ids = self._draft(req, budget) if num == need == 1 else []
                num += len(req.spec_token_ids)
            while allocate(req, num) is None:
                if req.spec_token_ids:  # drafts are optional: drop them before preempting anyone
                    num -= len(req.spec_token_ids)
                    req.spec_token_ids = []
                    continue
                victim = max(self.running, key=self._victim_key)
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is running:
                if req.images:
                    self._commit_images(req, req.num_computed_tokens, num, todo, out)
                scheduled[req.request_id] = num
                budget -= num

        # Second priority: board waiting requests with what budget is left. After a preemption
        # for memory nobody boards in that step (let memory drain), except, with priority
        # preemption, requests more urgent than everyone preempted.
        if not out.preempted_req_ids or self.config.priority_preemption:
            self._board_waiting(out, scheduled, budget)

        self._in_flight = {}
        self._advance(self.running, scheduled, out)
        if self._enc.dropped:
            self._finish_read_images(out)
        for h, upto in self._enc.upto.items():
            self.encoded[h] = max(self.encoded.get(h, 0), upto)
        if self.encoder_refs or self._unread:
            self._free_encoder_outputs(out)
        if states is not None:
            self._place_states(out)
        out.num_kv_blocks_used = self.kv.pool.num_used
        if out.is_empty:
            self._hold_back(out)
        return out

    def _hold_back(self, out: SchedulerOutput) -> None:
        """An output with no chunks and no encoder work is not run (the engine skips it): its finished
        requests and freed encoder outputs go out with the next step that runs, so the executor
        still forgets them."""
        self._finished_since_last_step[:0] = out.finished_req_ids
        self._unread.extend(out.freed_encoder_hashes)
        out.finished_req_ids, out.freed_encoder_hashes = [], []

    def _place_states(self, out: SchedulerOutput) -> None:
        """A hybrid model's chunks name their requests' state slots, the snapshot a new request
        starts from, and the slot its state is kept in where the step ends at a snapshot point."""
        states = self.kv.states
        assert states is not None
        for c in out.chunks:
            req = self._in_flight[c.request_id]
            c.state_slot = states.slots[c.request_id]
            if not c.spec_token_ids:
                c.snapshot_slot = self.kv.snapshot_slot(req, c.start + c.num_tokens)
            else:  # a verify runs its tokens in order over the state, as a prefill chunk does
                c.decode = False
            copy = states.copies.get(c.request_id)  # held from boarding until its first step is over
            if copy is not None:
                out.state_copies.append(copy)

    def _advance(self, reqs: list[Request], scheduled: dict[str, int], out: SchedulerOutput) -> None:
        """Move each scheduled request's one counter by its tokens; a chunk each says where it ran
        from (in ``reqs``' order). Runs for every running request every step: locals, no calls."""
        in_flight, chunks, tables = self._in_flight, out.chunks, self.kv.block_tables
        for req in reqs:
            rid = req.request_id
            num = scheduled.get(rid)
            if not num:
                continue
            start = req.num_computed_tokens
            req.num_computed_tokens = end = start + num
            table = tables[rid]
            if len(table) > req.num_blocks_sent:
                new_block_ids = table[req.num_blocks_sent:]
                req.num_blocks_sent = len(table)
            else:
                new_block_ids = []
            in_flight[rid] = req
            drafts = req.spec_token_ids
            # An embedding request samples nothing: its prompt's end ends it.
            samples = end >= len(req.all_token_ids) and req.sampling_params.pooling is None
            chunks.append(ScheduledChunk(rid, start, num, new_block_ids, samples, drafts))

    def _board_waiting(self, out: SchedulerOutput, scheduled: dict[str, int], budget: int) -> None:
        """Board waiting requests in queue order while budget, sequence slots and blocks last.

        A request starts past its longest cached prefix: those tokens need no compute. Partial-
        prefill caps: when as many prompts as allowed are mid-prefill nobody more boards; a long
        prompt over the long cap is skipped (shorter ones behind it may board). Priority
        preemption: a request that cannot board preempts the least urgent running request less
        urgent than itself, and tries again.
        """
        caps, preempting = self.config.has_prefill_caps, self.config.priority_preemption
        prefills, long_prefills = self._count_prefills() if caps else (0, 0)
        skipped: list[Request] = []
        try:
            while self.waiting:
                if not preempting and (budget <= 0 or len(self.running) >= self.max_num_seqs):
                    break  # nobody more can board in this step
                req = self.waiting.peek()
                if req.request_id in out.preempted_req_ids:
                    break  # preempted in this step: it waits for the next one
                cached = self.kv.find_cached(req)
                num_cached = len(cached) * self.kv.block_size
                need = req.num_tokens - num_cached
                is_prefill, is_long = need > 1, self._is_long(req)
                if caps and is_prefill:
                    max_partial, max_long = self.config.max_num_partial_prefills, self.config.max_long_partial_prefills
                    if max_partial is not None and prefills >= max_partial:
                        break
                    if is_long and max_long is not None and long_prefills >= max_long:
                        skipped.append(self.waiting.pop())
                        continue
                num = self.kv.cut(req, num_cached, min(need, budget, self.chunk_cap))
                todo: list[tuple[int, int]] = []
                if req.images:
                    num, todo = self._plan_images(req, num_cached, num)
                    if num <= 0:  # its first image is being encoded (or waits for the encoder budget)
                        self._commit_images(req, num_cached, 0, todo, out)
                        break
                room = not out.preempted_req_ids or self._more_urgent_than_preempted(req, out)
                if room and self._try_allocate(req, num, need, budget, cached):
                    self._admit(req, num_cached, out)
                    if req.images:
                        self._commit_images(req, num_cached, num, todo, out)
                    scheduled[req.request_id] = num
                    budget -= num
                    prefills += is_prefill
                    long_prefills += is_prefill and is_long
                    continue
                victim = self._priority_victim(req, budget, scheduled, cached)
                if victim is None:
                    break
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim, out)
                if caps:
                    prefills, long_prefills = self._count_prefills()
        finally:
            for req in reversed(skipped):  # back in their places
                self.waiting.prepend(req)

    def _more_urgent_than_preempted(self, req: Request, out: SchedulerOutput) -> bool:
        """With priority preemption, the room a step freed by preempting less urgent requests
        (for memory or for ``req``) is ``req``'s to take."""
        key = self._victim_key(req)
        return self.config.priority_preemption and all(
            self._victim_key(self.requests[rid]) > key for rid in out.preempted_req_ids)

    def _try_allocate(self, req: Request, num: int, need: int, budget: int, cached: list[int]) -> bool:
        """Whether ``req`` can board with ``num`` tokens now (budget, a sequence slot, the whole
        prompt when chunking is off, the KV blocks); if so its blocks are taken."""
        return (budget > 0 and len(self.running) < self.max_num_seqs
                and (self.config.enable_chunked_prefill or need <= budget)
                and self.kv.allocate_slots(req, num, cached) is not None)

    def _admit(self, req: Request, num_cached: int, out: SchedulerOutput) -> None:
        queried, hits = self.kv.record_lookup(req, num_cached)
        self._stats.num_prefix_queried_tokens += queried
        self._stats.num_prefix_hit_tokens += hits
        req.num_computed_tokens = num_cached
        self.waiting.pop()
        if req.times.first_scheduled is None:
            req.times.first_scheduled = self.clock()
            req.num_cached_tokens = num_cached
            out.new_requests.append(self._new_request(req))
        req.status = RequestStatus.RUNNING
        req.boarded_step = self.num_steps
        self.running.append(req)

    def _is_long(self, req: Request) -> bool:
        return 0 < self.config.long_prefill_token_threshold < req.num_tokens

    def _count_prefills(self) -> tuple[int, int]:
        """Running requests mid-prefill (more than one token to compute), and how many are long."""
        mid = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        return len(mid), sum(1 for r in mid if self._is_long(r))

    def _priority_victim(self, req: Request, budget: int, scheduled: dict[str, int],
                         cached: list[int]) -> Request | None:
        """The running request ``req`` may preempt to board, or None.

        Candidates: running requests less urgent than ``req`` and not protected by the cooldown
        (a request preempted before cannot be preempted again until ``priority_preemption_cooldown``
        steps have passed since it boarded again). None as well when preempting all of them would
        still leave ``req`` no token of budget or no block, so nobody is preempted for nothing.
        """
        if not self.config.priority_preemption:
            return None
        key, cooldown = self._victim_key(req), self.config.priority_preemption_cooldown
        candidates = [r for r in self.running if self._victim_key(r) > key
                      and (r.num_preemptions == 0 or self.num_steps - r.boarded_step >= cooldown)]
        if not candidates:
            return None
        # The room once all candidates are gone: their budget this step, and the blocks that only
        # they reference. ``req``'s cached blocks that nobody references then must be taken from
        # that free room too (as allocate_slots counts them).
        bs, ref = self.kv.block_size, self.kv.pool.ref_counts
        room_budget = budget + sum(scheduled.get(r.request_id, 0) for r in candidates)
        held = Counter(b for r in candidates for b in self.kv.block_tables.get(r.request_id, ()))
        room_blocks = self.kv.pool.num_free + sum(1 for b, n in held.items() if ref[b] == n)
        reclaimed = sum(1 for b in cached if ref[b] == held[b])
        need = req.num_tokens - len(cached) * bs
        first = min(need, room_budget, self.chunk_cap) if self.config.enable_chunked_prefill else need
        if room_budget <= 0 or first > room_budget \
                or blocks_for(len(cached) * bs + first, bs) - len(cached) + reclaimed > room_blocks:
            return None
        return max(candidates, key=self._victim_key)

    def _draft(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request: as many as the budget, max_tokens and max_model_len
        leave room for (a draft model's are placeholders its executor fills). None for requests whose
        next-token rule depends on the tokens before it in ways the verify step does not replay
        (penalties, grammars)."""
        spec = self.spec
        assert spec is not None
        if not self._can_draft(req):
            return []
        if spec.disable_by_batch_size is not None and len(self.running) >= spec.disable_by_batch_size:
            return []
        k = min(self._ks.get(req.request_id, 0) if self.acceptance is not None else spec.num_speculative_tokens,
                budget - 1, self._k_cap(req))
        if k <= 0:
            return []
        if spec.method in ("draft_model", "mtp"):
            # Slots only: the executor's draft model (or MTP head) writes the k tokens in before the verify runs.
            return [0] * k
        return propose_ngram(req.all_token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _can_draft(self, req: Request) -> bool:
        """Whether ``req``'s next-token rule lets a verify replay it (no penalties, no grammar)."""
        sp = req.sampling_params
        # A hybrid model verifies the drafts of its MTP head only: a verify that rejects one is
        # computed again from its start (its recurrent state is not rewound past a token).
        hybrid_off = self.kv.states is not None and (self.spec is None or self.spec.method != "mtp")
        return not (sp.has_penalties or sp.structured_outputs is not None or hybrid_off)

    def _k_cap(self, req: Request) -> int:
        """The most drafts ``req`` may carry: its max_tokens and max_model_len leave room for them
        and the verify's own token."""
        assert self.spec is not None
        return min(self.spec.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens - 1)

    def _choose_ks(self, budget: int) -> dict[str, int]:
        """adaptive_k: this step's draft length for each decoding request (``ferry.core.spec_k``),
        the other running requests' prefill tokens counted in the step's cost."""
        assert self.acceptance is not None and self.spec is not None
        decoding, other = [], 0
        for req in self.running:
            need = len(req.all_token_ids) - req.num_computed_tokens
            if need == 1:
                decoding.append(req)
            else:
                other += min(need, self.chunk_cap)
        other = min(other, max(budget - len(decoding), 0))
        rates = [self.acceptance.rate(r.request_id) for r in decoding]
        caps = [max(self._k_cap(r), 0) if self._can_draft(r) else 0 for r in decoding]
        assert self.choose_ks is not None
        ks = self.choose_ks(rates, caps, self.spec.step_cost, other)
        for r, k in zip(decoding, ks):
            if k == 0:
                self.acceptance.idle(r.request_id)
        return {r.request_id: k for r, k in zip(decoding, ks)}

    def _new_request(self, req: Request) -> NewRequest:
        return NewRequest(req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_ids, req.images)

    # ------------------------------------------------------------------ images
    def _start_encoder_step(self) -> None:
        """A fresh encoder budget; the references of requests the last step carried past their images end."""
        self._enc = _EncoderStep(self.encoder_budget)
        for h, rid in self._encoder_releases:
            refs = self.encoder_refs.get(h)
            if refs is not None:
                refs.discard(rid)
        self._encoder_releases = []

    def _plan_images(self, req: Request, start: int, num: int) -> tuple[int, list[tuple[int, int]]]:
        """``num`` cut before the first image the chunk [start, start + num) touches whose encoding
        is not done by the end of this step (0: not even the chunk's first token), and the encoder
        work to run for it: (image index, tokens' worth its encoding reaches), within the step's
        encoder budget left (an image larger than the budget is encoded over several steps)."""
        overran = False
        if self.whole_images:
            num, overran = self._whole_images(req, start, num)
        end, todo, left = start + num, [], self._enc.left
        upto = dict(self._enc.upto)
        for i, im in enumerate(req.images):
            if im.offset >= end:
                break
            if im.end <= start:
                continue
            done = max(self.encoded.get(im.hash, 0), upto.get(im.hash, 0))
            if done < im.length and left > 0:
                more = min(left, im.length - done)
                left -= more
                done = upto[im.hash] = done + more
                todo.append((i, done))
            if done < im.length:
                if overran:  # the chunk stops before the image it would have taken whole: another may
                    self._enc.overrun = False
                return max(0, im.offset - start), todo
        return num, todo

    def _whole_images(self, req: Request, start: int, num: int) -> tuple[int, bool]:
        """``num`` such that the chunk [start, start + num) cuts no image: it ends before an image it
        would cut, or, when that image is where the chunk starts, takes the image whole, past the
        step's token budget if it must (one such chunk a step: then True); 0: the image waits for
        the next step."""
        end = start + num
        for im in req.images:
            if im.offset >= end:
                break
            if im.end <= end or im.end <= start:
                continue  # inside the chunk, or before it
            if im.offset > start:
                return im.offset - start, False
            if self._enc.overrun:
                return 0, False
            self._enc.overrun = True
            return im.end - start, True
        return num, False

    def _commit_images(self, req: Request, start: int, num: int, todo: list[tuple[int, int]],
                       out: SchedulerOutput) -> None:
        """A scheduled chunk's images (``num`` may be 0: encoder work alone): run the planned
        encoder work, and hold every image it encodes or the chunk touches until the chunk that
        passes its end has run."""
        enc, rid, end = self._enc, req.request_id, start + num
        mine = {i for i, _ in todo}
        self._stats.num_encoder_cache_hits += sum(1 for i, im in enumerate(req.images)
                                                  if start <= im.offset < end and i not in mine)
        for i, upto in todo:
            im = req.images[i]
            out.encoder_inputs.append((rid, im, upto))
            enc.left -= upto - max(self.encoded.get(im.hash, 0), enc.upto.get(im.hash, 0))
            enc.upto[im.hash] = upto
            self.encoder_refs.setdefault(im.hash, set()).add(rid)
        last = {im.hash: im.end for im in req.images}  # the same image twice: held until its last span
        for im in req.images:
            if im.overlaps(start, end):
                self.encoder_refs.setdefault(im.hash, set()).add(rid)
                if end >= last[im.hash] == im.end:
                    self._encoder_releases.append((im.hash, rid))
            elif last[im.hash] <= start and rid in self.encoder_refs.get(im.hash, ()):
                # encoded for it while it waited, then passed by a prefix-cache hit: no chunk reads it
                self._encoder_releases.append((im.hash, rid))

    def _drop_images(self, req: Request) -> None:
        """A request that leaves (finished or preempted) reads none of its images' outputs any more."""
        for im in req.images:
            refs = self.encoder_refs.get(im.hash)
            if refs is not None:
                refs.discard(req.request_id)

    def _finish_read_images(self, out: SchedulerOutput) -> None:
        """Every image a chunk reads is encoded whole by the end of the step: a chunk may have been
        planned on another request's encoder work that a later preemption in the step dropped."""
        enc = self._enc
        for c in out.chunks:
            req = self._in_flight[c.request_id]
            for im in req.images:
                if im.overlaps(c.start, c.start + c.num_tokens) and \
                        max(self.encoded.get(im.hash, 0), enc.upto.get(im.hash, 0)) < im.length:
                    out.encoder_inputs.append((c.request_id, im, im.length))
                    enc.upto[im.hash] = im.length

    def _drop_encoder_work(self, req: Request, out: SchedulerOutput) -> None:
        """A request preempted in the step that planned its encoder work: that work is not run, and
        the step's encodings reach only what the rest of its encoder work takes them to."""
        rid = req.request_id
        out.encoder_inputs = [e for e in out.encoder_inputs if e[0] != rid]
        upto: dict[bytes, int] = {}
        for _, im, n in out.encoder_inputs:
            upto[im.hash] = max(upto.get(im.hash, 0), n)
        self._enc.upto = upto
        self._enc.dropped = True

    def _free_encoder_outputs(self, out: SchedulerOutput) -> None:
        """Encoder outputs no request will read again: the executor drops them before this step."""
        out.freed_encoder_hashes.extend(self._unread)
        self._unread = []
        out.freed_encoder_hashes.extend(self._unreferenced())

    def _unreferenced(self) -> list[bytes]:
        """Forget the images no request will read again (the executor is to drop them)."""
        gone = [h for h, refs in self.encoder_refs.items() if not refs]
        for h in gone:
            del self.encoder_refs[h]
            self.encoded.pop(h, None)
        return gone

    def _victim_key(self, req: Request) -> tuple:
        # The last-arrived goes first; under "priority", the least urgent first.
        if self.config.scheduling_policy == "priority":
            return priority_key(req, self.config.priority_aging_rate)
        return (req.seq,)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute-style preemption: free blocks, forget progress, back to the queue head."""
        out.preempted_req_ids.append(req.request_id)
        self.running.remove(req)
        if req.images:
            self._drop_images(req)
            self._drop_encoder_work(req, out)
        self.kv.free(req)
        req.num_recomputed_tokens += req.num_computed_tokens  # work that will be done again
        req.num_computed_tokens = 0
        req.num_blocks_sent = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._stats.num_preempted += 1
        self.waiting.prepend(req)

    def _take_finished(self) -> list[str]:
        done, self._finished_since_last_step = self._finished_since_last_step, []
        return done

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, and the encoder outputs no request reads (the executor drops
        them before the next step; the same image is then encoded again). Returns how many blocks
        the cache held."""
        self._unread.extend(self._unreferenced())
        return self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------ after the step
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Append sampled tokens, check token-level stops, free finished requests.

        Returns the requests that got new tokens or finished in this step. With drafts, only
        the accepted tokens' KV stays computed; the rejected slots are overwritten later.
        """
        now = self.clock()
        changed: list[Request] = []
        errors, in_flight, stats = result.errors, self._in_flight, self._stats
        for chunk in out.chunks:
            rid = chunk.request_id
            req = in_flight.get(rid)
            if req is None or req.status.finished or chunk.padding:
                continue  # aborted while the step ran, or static-batch padding
            if errors and rid in errors:
                self.finish_request(req, RequestStatus.FINISHED_ERROR, errors[rid])
                changed.append(req)
                continue
            if not chunk.samples:
                self.kv.after_step(req)
                if req.sampling_params.pooling is not None and req.num_computed_tokens >= req.num_prompt_tokens:
                    req.embedding = result.pooled.get(rid)
                    self.finish_request(req, RequestStatus.FINISHED_STOPPED)
                    changed.append(req)
                continue  # a prefill chunk short of the prompt's end: no token yet
            tokens = result.sampled[rid]
            if chunk.spec_token_ids:
                accepted = len(tokens) - 1
                req.num_computed_tokens -= len(chunk.spec_token_ids) - accepted
                if self.kv.states is not None and accepted < len(chunk.spec_token_ids):
                    # The executor put the state back as it was before the verify: its tokens run again.
                    req.num_computed_tokens = chunk.start
                self.num_drafts += 1
                self.num_draft_tokens += len(chunk.spec_token_ids)
                self.num_accepted_tokens += accepted
                stats.num_drafts += 1
                stats.num_draft_tokens += len(chunk.spec_token_ids)
                stats.num_accepted_tokens += accepted
                if self.acceptance is not None:
                    self.acceptance.observe(rid, len(chunk.spec_token_ids), accepted)
            if req.spec_token_ids:
                req.spec_token_ids = []
            status = None
            times = req.times
            if times.first_token is None:
                times.first_token = now
            token_times = times.token_times
            for token in tokens:
                req.append_output_token(token)
                token_times.append(now)
                status = self._check_stop(req, token)
                if status is not None:
                    break  # later accepted drafts are dropped
            self.kv.after_step(req)  # before a finish frees them: a finished prefix is reusable
            if status is not None:
                self.finish_request(req, status)
            changed.append(req)
        if errors and out.encoder_inputs:  # a request whose image failed to encode, in a step without its chunk
            chunked = {c.request_id for c in out.chunks}
            for rid in dict.fromkeys(r for r, _, _ in out.encoder_inputs if r in errors and r not in chunked):
                req = self.requests.get(rid)
                if req is not None and not req.status.finished:
                    self.finish_request(req, RequestStatus.FINISHED_ERROR, errors[rid])
                    changed.append(req)
        return changed

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        """Token-level stops; stop strings are the output processor's (it sees the text)."""
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens and (req.eos_token_ids or sp.stop_token_ids):
            if token in req.eos_token_ids and not sp.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
