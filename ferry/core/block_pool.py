"""A fixed pool of KV-cache blocks with a free list."""
from __future__ import annotations


class BlockPool:
    """Hands out block ids from a free list; blocks are interchangeable.

    The free list is a stack: the blocks freed last are taken first. The KV cache's pages are
    zeroed lazily by the OS, so only blocks ever written take memory; a queue would cycle
    through every block of the pool and make all of it resident (a server's RSS grew by the
    whole 2 GiB cache), a stack keeps it to the most blocks ever in use at once.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # block 0 on top

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def take(self, n: int) -> list[int] | None:
        """Take ``n`` blocks, or None (and take nothing) if fewer are free."""
        if n > len(self._free):
            return None
        if n <= 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
