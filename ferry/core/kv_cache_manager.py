"""Block tables: which KV blocks hold which request's tokens."""
from __future__ import annotations

from ferry.core.block_pool import BlockPool
from ferry.core.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Gives each request the blocks its computed tokens need, and takes them back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for ``num_new_tokens`` more computed tokens of ``request``.

        Takes only the blocks those tokens need. Returns the newly taken block ids
        (possibly empty), or None, taking nothing, when the pool cannot give them.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        needed = blocks_for(request.num_computed_tokens + num_new_tokens, self.block_size) - len(table)
        if needed <= 0:
            return []
        new = self.pool.take(needed)
        if new is None:
            if not table:
                del self.block_tables[request.request_id]
            return None
        table.extend(new)
        return new

    def free(self, request: Request) -> None:
        """Return all of ``request``'s blocks to the pool (finish, abort or preemption)."""
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.pool.give_back(table)
