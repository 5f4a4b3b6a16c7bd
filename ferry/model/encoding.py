"""An image's encoding cut into pieces, so a step can run a share of it (the encoder budget).

A tower's ``encode_pieces`` is a generator: it yields after each piece of work (a block's
projections, a block's rows in chunks, a merger) the share of the whole that is done, at most 1,
and returns the output. ``EncodeJob`` runs such a generator a share at a time; ``run_all`` at once.
"""
from __future__ import annotations

from collections.abc import Generator
from typing import Any

Pieces = Generator[float, None, Any]

# The most patch rows one piece of a tower's block takes: about a quarter of a 448x448 image's 784
# patches, so a piece costs about as much as a block's projections.
PIECE_ROWS = 256


def row_spans(n: int, most: int = PIECE_ROWS) -> list[tuple[int, int]]:
    """[lo, hi) spans of about equal size, at most ``most`` rows each, covering ``n`` rows."""
    chunks = -(-n // most)
    step = -(-n // chunks)
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


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
        to_the_end = share >= 1  # the last piece yields 1 before the output comes
        while not self.done and (to_the_end or self.share < share):
            try:
                self.share = next(self.pieces)
            except StopIteration as e:
                self.output, self.done = e.value, True
        return self.output
