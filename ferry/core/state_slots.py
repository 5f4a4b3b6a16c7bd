"""Recurrent-state slots: each running request of a hybrid model (Gated DeltaNet, Mamba2, short-conv
layers) holds one slot, a fixed-size state per recurrent layer, beside its paged KV blocks.

A state cannot be rewound the way paged KV can, so the prefix cache keeps snapshots: the state of a
request at a block boundary (every ``interval`` tokens, and at its prompt's last full block), in a
slot of its own, keyed by the hash of the block that ends there. A new request whose cached
prefix reaches such a block starts from a copy of that snapshot. Snapshots are slots nobody
holds, evicted least recently used when a request needs a slot, and dropped when the KV block
of their hash is evicted (``forget``). Chunks never cross a snapshot point (``cut``), so a
snapshot is the state at the end of a step: the executor copies it after the step.
"""
from __future__ import annotations

from dataclasses import dataclass

from ferry.core.block_pool import BlockPool


@dataclass
class _Snapshot:
    slot: int
    block_hash: bytes


class StateSlots:
    """The slots, who holds which, and the snapshots of the prefix cache."""

    def __init__(self, num_slots: int, block_size: int, interval: int, enable_caching: bool) -> None:
        if num_slots < 1:
            raise ValueError(f"num_state_slots must be >= 1, got {num_slots}")
        self.pool = BlockPool(num_slots)
        self.block_size = block_size
        self.interval = interval
        self.enable_caching = enable_caching
        self.slots: dict[str, int] = {}  # request id -> its slot
        # Request id -> (snapshot slot, its own slot): copied before the request's first step, the
        # snapshot held until that step is over.
        self.copies: dict[str, tuple[int, int]] = {}
        self.snapshots: dict[str, _Snapshot] = {}  # request id -> the snapshot its step in flight writes

    @property
    def num_slots(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used(self) -> int:
        """Slots held by requests (and by snapshots being written or copied)."""
        return self.pool.num_used

    def resumable(self, hashes: list[bytes], found: int) -> int:
        """Of ``found`` cached leading blocks (whose hashes are ``hashes``), how many a request can
        start after: the deepest that ends where a snapshot of the state was kept."""
        for n in range(found, 0, -1):
            if self.pool.lookup(hashes[n - 1]) is not None:
                return n
        return 0

    def take(self, request_id: str, resume_from: bytes | None) -> bool:
        """Give ``request_id`` a slot, to be filled from the snapshot of ``resume_from`` (a block
        hash) when given; False, taking nothing, when no slot is free."""
        src = None if resume_from is None else self.pool.lookup(resume_from)
        held = src is not None and self.pool.ref_counts[src] == 0  # touching it takes it from the free room
        if self.pool.num_free < 1 + held:
            return False
        if src is not None:
            self.pool.touch([src])
        slot = self.pool.take(1)
        assert slot is not None
        self.slots[request_id] = slot[0]
        if src is not None:
            self.copies[request_id] = (src, slot[0])
        return True

    def cut(self, prompt_len: int, start: int, num: int) -> int:
        """``num`` cut so that a chunk from ``start`` ends at the next snapshot point it would cross."""
        if not self.enable_caching:
            return num
        nxt = (start // self.interval + 1) * self.interval
        last = prompt_len // self.block_size * self.block_size  # the prompt's last full block
        if start < last < nxt:
            nxt = last
        return min(num, nxt - start)

    def snapshot_at(self, request_id: str, prompt_len: int, end: int, block_hash: bytes | None) -> int:
        """The slot a step ending at ``end`` copies the request's state into for the prefix cache,
        or -1 (not a snapshot point, already kept, or no slot free)."""
        if not self.enable_caching or block_hash is None or end % self.block_size:
            return -1
        if end % self.interval and end != prompt_len // self.block_size * self.block_size:
            return -1
        if self.pool.lookup(block_hash) is not None or request_id in self.snapshots:
            return -1
        slot = self.pool.take(1)
        if slot is None:
            return -1
        self.snapshots[request_id] = _Snapshot(slot[0], block_hash)
        return slot[0]

    def step_done(self, request_id: str) -> None:
        """A step of ``request_id`` ran: the snapshot it copied from is let go, the one it wrote
        joins the prefix cache."""
        copy = self.copies.pop(request_id, None)
        if copy is not None:
            self.pool.give_back([copy[0]])
        snap = self.snapshots.pop(request_id, None)
        if snap is not None:
            self.pool.cache(snap.slot, snap.block_hash)
            self.pool.give_back([snap.slot])  # a slot left unregistered (kept already) is simply free

    def release(self, request_id: str) -> None:
        """``request_id`` finished or was preempted: its slot and whatever it held go back."""
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.pool.give_back([slot])
        copy = self.copies.pop(request_id, None)
        if copy is not None:
            self.pool.give_back([copy[0]])
        snap = self.snapshots.pop(request_id, None)
        if snap is not None:
            self.pool.give_back([snap.slot])  # never registered: its contents may be half-written

    def forget(self, block_hash: bytes) -> None:
        """The KV block of ``block_hash`` left the prefix cache: its snapshot goes too."""
        self.pool.forget(block_hash)

    def reset(self) -> int:
        """Forget every snapshot. Returns how many there were."""
        return self.pool.reset_cache()
