"""An image's encoding cut into pieces, so a step can run a share of it (the encoder budget).

A tower's ``encode_pieces`` is a generator: it yields after each piece of work (a block's
projections, a block's rows in chunks, a merger) the share of the whole that is done, at most 1,
and returns the output. ``EncodeJob`` runs such a generator a share at a time; ``run_all`` at once.
"""
from __future__ import annotations

from collections.abc import Generator
from typing import Any

Pieces = Generator[float, None, Any]


def run_all(pieces: Pieces) -> Any:
    """The generator's output, every piece run."""
    while True:
        try:
            next(pieces)
        except StopIteration as e:
            return e.value


def shares(n: int) -> list[float]:
    """The share done after each of ``n`` pieces of about equal work."""
    return [(k + 1) / n for k in range(n)]


class EncodeJob:
    """One image's encoding in progress: ``run_to(share)`` runs pieces until that share is done."""

    __slots__ = ("pieces", "share", "output", "done", "seconds")

    def __init__(self, pieces: Pieces) -> None:
        self.pieces = pieces
        self.share = 0.0
        self.output: Any = None
        self.done = False
        self.seconds = 0.0  # spent on it so far, over every step that ran a share

    def run_to(self, share: float) -> Any:
        """Run pieces until ``share`` (of 1) is done; at 1 or more, to the end. The output once
        the last piece has run, else None."""
        while not self.done and (self.share < share or share >= 1):
            try:
                self.share = next(self.pieces)
            except StopIteration as e:
                self.output, self.done = e.value, True
        return self.output
