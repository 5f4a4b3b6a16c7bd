"""Block tables: which KV blocks hold which request's tokens, and the prefix cache over them."""
from __future__ import annotations

import hashlib
from array import array

from ferry.core.block_pool import BlockPool
from ferry.core.request import Request
from ferry.core.state_slots import StateSlots


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def hash_block(parent: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    """A full block's identity: its tokens, everything before them (through ``parent``, the
    previous block's hash) and ``extra`` (anything else that changes the KV, e.g. an adapter).
    A cryptographic hash, so one tenant cannot craft a prompt that collides with another's."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


class KVCacheManager:
    """Gives each request the blocks its computed tokens need, and takes them back.

    With ``enable_caching``, a request's full computed blocks are registered by hash chain
    (``cache_blocks``) and a new request starts from its longest cached run of full blocks
    (``find_cached``): those tokens need no compute.

    With ``window`` (every layer of the model attends only to the last ``window`` positions),
    blocks that no future query can see are given back as the request moves on
    (``release_outside_window``); its table keeps their ids, which nothing reads again.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 window: int | None = None, num_state_slots: int = 0, snapshot_interval: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        # A hybrid model's recurrent-state slots (``ferry.core.state_slots``), whose snapshots leave
        # the prefix cache with their blocks.
        self.states = StateSlots(num_state_slots, block_size, snapshot_interval or block_size, enable_caching) \
            if num_state_slots else None
        self.pool = BlockPool(num_blocks, on_evict=self.states.forget if self.states else None)
        self.block_tables: dict[str, list[int]] = {}
        self.enable_caching = enable_caching
        self.num_queried_tokens = 0  # prompt tokens looked up in the cache
        self.num_hit_tokens = 0  # of those, found there
        self.window = window
        self.released: dict[str, int] = {}  # request id -> leading blocks of its table given back

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def _hashes(self, req: Request) -> list[bytes]:
        """The hash chain of ``req``'s full blocks of known tokens, extended as tokens arrive."""
        hashes, bs, tokens, images = req.block_hashes, self.block_size, req.all_token_ids, req.images
        for i in range(len(hashes), len(tokens) // bs):
            # A block that holds part of an image's span is that image's too (its KV depends on the pixels).
            extra = b"".join(im.hash for im in images if im.overlaps(i * bs, (i + 1) * bs)) if images else b""
            hashes.append(hash_block(hashes[-1] if hashes else b"", tokens[i * bs:(i + 1) * bs], extra))
        return hashes

    def find_cached(self, req: Request) -> list[int]:
        """The blocks of ``req``'s longest cached prefix, at most ``num_tokens - 1`` tokens: the last
        token is always computed, as its logits give the next token. Takes nothing. A request
        that asks for prompt logprobs needs every prompt position's logits, and a mean-pooled
        embedding every position's hidden state: they reuse nothing."""
        sp = req.sampling_params
        if not self.enable_caching or sp.prompt_logprobs is not None or sp.pooling == "mean":
            return []
        found = []
        hashes = self._hashes(req)
        for h in hashes[:(req.num_tokens - 1) // self.block_size]:
            b = self.pool.lookup(h)
            if b is None:
                break
            found.append(b)
        if self.states is not None:  # a recurrent state resumes only where a snapshot was kept
            found = found[:self.states.resumable(hashes, len(found))]
        return found

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached: list[int] | None = None) -> list[int] | None:
        """Make room for ``num_new_tokens`` more computed tokens of ``request``.

        ``cached``: blocks from ``find_cached`` the request starts with (its table must be
        empty; they count as computed once this succeeds). Takes only the blocks those tokens
        need. Returns the newly taken block ids (possibly empty), or None, taking nothing,
        when the pool cannot give them.
        """
        table = self.block_tables.get(request.request_id)
        if table is None:
            table = self.block_tables[request.request_id] = []
        elif not cached and request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
            return []  # the common decode step: room in the last block
        computed = request.num_computed_tokens + (len(cached) * self.block_size if cached else 0)
        needed = blocks_for(computed + num_new_tokens, self.block_size) - len(table) - (len(cached) if cached else 0)
        # Cached blocks nobody holds are counted free: reusing them takes them from the pool too.
        reclaimed = sum(1 for b in cached if self.pool.ref_counts[b] == 0) if cached else 0
        if needed + reclaimed > self.pool.num_free or (
                self.states is not None and not table and not self._take_state(request, cached)):
            if not table:
                del self.block_tables[request.request_id]
            return None
        if cached:
            assert not table and request.num_computed_tokens == 0
            self.pool.touch(cached)
            table.extend(cached)
        if needed <= 0:
            return []
        new = self.pool.take(needed)
        assert new is not None
        table.extend(new)
        return new

    def _take_state(self, request: Request, cached: list[int] | None) -> bool:
        """A slot for the recurrent state of a request that starts (from the snapshot ending its
        cached prefix, if any)."""
        assert self.states is not None
        resume = request.block_hashes[len(cached) - 1] if cached else None
        return self.states.take(request.request_id, resume)

    def cut(self, request: Request, start: int, num: int) -> int:
        """A chunk's ``num`` tokens from ``start``, cut at the next point where the prefix cache keeps
        a recurrent-state snapshot (a hybrid model's; otherwise ``num``)."""
        if self.states is None or num <= 1:
            return num
        return self.states.cut(request.num_prompt_tokens, start, num)

    def snapshot_slot(self, request: Request, end: int) -> int:
        """The slot the state of ``request`` at ``end`` (its step's end) is kept in, or -1."""
        if self.states is None or not self.enable_caching or end % self.block_size:
            return -1
        hashes = self._hashes(request)
        h = hashes[end // self.block_size - 1] if end // self.block_size <= len(hashes) else None
        return self.states.snapshot_at(request.request_id, request.num_prompt_tokens, end, h)

    def record_lookup(self, request: Request, num_hit_tokens: int) -> tuple[int, int]:
        """Count one admitted request's cache lookup; returns what it counted (prompt tokens looked
        up, of them found), both 0 without caching: the step's statistics add them up."""
        if not self.enable_caching:
            return 0, 0
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += num_hit_tokens
        return request.num_tokens, num_hit_tokens

    def cache_blocks(self, request: Request) -> None:
        """Register ``request``'s full blocks whose KV is now computed (after a successful step)."""
        if not self.enable_caching or request.num_computed_tokens // self.block_size <= request.num_cached_blocks:
            return  # no block filled since the last call
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        full = min(request.num_computed_tokens // self.block_size, len(table))
        if full <= request.num_cached_blocks:
            return
        hashes = self._hashes(request)
        for i in range(request.num_cached_blocks, full):
            self.pool.cache(table[i], hashes[i])
        request.num_cached_blocks = full

    def after_step(self, request: Request) -> None:
        """A step computed more of ``request``: register its newly full blocks, then give back those
        its window has passed (in that order, so a cached prefix stays whole)."""
        self.cache_blocks(request)
        if self.states is not None:
            self.states.step_done(request.request_id)
        self.release_outside_window(request)

    def release_outside_window(self, request: Request) -> None:
        """Give back ``request``'s blocks that lie wholly before every future query's window (after a
        step, its computed tokens final). Cached blocks stay in the prefix cache for others."""
        if self.window is None:
            return
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        # The next query sits at num_computed_tokens and sees (num_computed_tokens - window, ...].
        first_seen = max(0, request.num_computed_tokens - self.window + 1)
        upto = min(first_seen // self.block_size, len(table))
        if self.enable_caching:
            upto = min(upto, request.num_cached_blocks)  # registered first, so the prefix stays reusable
        done = self.released.get(request.request_id, 0)
        if upto > done:
            self.pool.give_back(table[done:upto])
            self.released[request.request_id] = upto

    def free(self, request: Request) -> None:
        """Drop ``request``'s references to its blocks (finish, abort or preemption)."""
        table = self.block_tables.pop(request.request_id, None)
        done = self.released.pop(request.request_id, 0)
        request.num_cached_blocks = 0
        if table:
            self.pool.give_back(table[done:])
        if self.states is not None:
            self.states.release(request.request_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (for benchmarks and tests). Returns how many blocks it held."""
        if self.states is not None:
            self.states.reset()
        return self.pool.reset_cache()
