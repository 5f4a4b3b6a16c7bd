"""A fixed pool of KV-cache blocks: reference counts, and a cache of full blocks by content hash."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class BlockPool:
    """Hands out block ids; a block is in use while some request references it.

    A full block whose KV is computed can be registered under the hash of its contents
    (``cache``). When its last reference goes, it keeps that hash and joins an LRU list of
    cached free blocks, so a later request with the same prefix takes it back (``touch``)
    instead of computing it again. It is evicted (its hash forgotten) only when a new block is
    needed and no never-cached free block is left.

    The never-cached free blocks are a stack: the blocks freed last are taken first. The KV
    cache's pages are zeroed lazily by the OS, so only blocks ever written take memory; a queue
    would cycle through every block of the pool and make all of it resident, a stack keeps it
    to the most blocks ever in use at once (plus what the prefix cache chooses to keep).
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[bytes], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.on_evict = on_evict  # told each hash the cache forgets to make room
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # block 0 on top
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # content hash -> the block that holds it

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: never-cached plus evictable cached ones."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def take(self, n: int) -> list[int] | None:
        """Take ``n`` fresh blocks (reference count 1), or None (and take nothing) if fewer are free."""
        if n > self.num_free:
            return None
        if n <= 0:
            return []
        k = min(n, len(self._free))
        taken = self._free[len(self._free) - k:]
        del self._free[len(self._free) - k:]
        taken.reverse()
        while len(taken) < n:  # evict the least recently freed cached blocks
            b, _ = self._cached_free.popitem(last=False)
            h = self.block_hash[b]
            del self.cached[h]  # type: ignore[index]
            self.block_hash[b] = None
            taken.append(b)
            if self.on_evict is not None:
                self.on_evict(h)  # type: ignore[arg-type]
        for b in taken:
            self.ref_counts[b] = 1
        return taken

    def touch(self, blocks: list[int]) -> None:
        """Add a reference to each of ``blocks`` (cached blocks a new request reuses)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._cached_free[b]
            self.ref_counts[b] += 1

    def give_back(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks``; a block nobody references is free again.

        Pass a request's table in order: its last blocks become the first to be evicted, as a
        prefix's tail is the least likely part to be shared.
        """
        for b in reversed(blocks):
            rc = self.ref_counts[b] - 1
            assert rc >= 0, f"block {b} freed more often than taken"
            self.ref_counts[b] = rc
            if rc == 0:
                if self.block_hash[b] is None:
                    self._free.append(b)
                else:
                    self._cached_free[b] = None

    # ------------------------------------------------------------------ the prefix cache
    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register ``block`` (in use, full, computed) as holding the contents ``block_hash`` names.
        If another block already holds them, this one stays unregistered: the first is shared."""
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.block_hash[block] = block_hash
            self.cached[block_hash] = block

    def forget(self, block_hash: bytes) -> None:
        """Unregister the block holding ``block_hash``, if any: free now if nobody holds it."""
        b = self.cached.pop(block_hash, None)
        if b is None:
            return
        self.block_hash[b] = None
        if self.ref_counts[b] == 0:
            del self._cached_free[b]
            self._free.append(b)

    def reset_cache(self) -> int:
        """Forget every hash (blocks in use stay in use). Returns how many blocks were cached."""
        n = len(self.cached)
        for b in self.cached.values():
            self.block_hash[b] = None
        self.cached.clear()
        self._free.extend(self._cached_free)
        self._cached_free.clear()
        return n
