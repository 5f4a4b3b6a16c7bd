"""A fixed pool of KV-cache blocks with a free list."""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids from a free list; blocks are interchangeable."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

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
        return [self._free.popleft() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
