"""The executor's side of images: the encoder cache and each step's image rows.

The scheduler names the images to encode before a step, each with how far
(``SchedulerOutput.encoder_inputs``: an image's encoding may run across steps, a share a step, in
the pieces of ``ferry.model.encoding``), and the outputs no chunk will read again
(``freed_encoder_hashes``). Outputs, and encodings in progress, are kept by image hash, so the same
image in several requests is encoded once. A chunk may cut an image's span anywhere: it takes the
rows of the output its tokens cover. Rope positions come from each request's images
(``ferry.model.multimodal.RequestPositions``): a text-only request's stay as packed.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from ferry.core.outputs import RequestFailed, SchedulerOutput
from ferry.executor.batch import PackedBatch, row_groups
from ferry.executor.request_state import RequestStates
from ferry.model.encoding import EncodeJob
from ferry.model.layers.vision import VisionOutput
from ferry.model.multimodal import ImageEncoder, ImageRows, RequestPositions


class ImageSteps:
    """Encoder outputs by image hash, and the image rows of each step's packed batch."""

    def __init__(self, encoder: ImageEncoder, bidirectional: bool = False) -> None:
        self.encoder = encoder
        # The model attends each image's tokens both ways in prefill (``Architecture.bidirectional_images``):
        # each prefill span names the images its chunk holds (whole: the scheduler never cuts one).
        self.bidirectional = bidirectional
        self.cache: dict[bytes, VisionOutput] = {}
        self.jobs: dict[bytes, EncodeJob] = {}  # encodings in progress
        self.positions: dict[str, RequestPositions] = {}
        self.seconds: list[float] = []  # each image finished since the last ``take_seconds`` (all its steps)

    def take_seconds(self) -> list[float]:
        """The encoder's seconds per image finished since the last call (once per step)."""
        out, self.seconds = self.seconds, []
        return out

    def apply(self, out: SchedulerOutput) -> None:
        """Drop the freed outputs (and encodings in progress), forget finished requests, and run each
        scheduled image's encoding as far as the step takes it; an image that fails to encode
        raises ``RequestFailed`` naming the request whose work it was."""
        for h in out.freed_encoder_hashes:
            self.cache.pop(h, None)
            self.jobs.pop(h, None)
        for rid in out.finished_req_ids:
            self.positions.pop(rid, None)
        for rid, image, upto in out.encoder_inputs:
            try:
                self._advance(image, upto / image.length)
            except Exception as e:
                raise RequestFailed(rid, e) from e

    def _advance(self, image: Any, share: float) -> VisionOutput | None:
        """Run the image's encoding until ``share`` of it is done (at 1, to its output)."""
        got = self.cache.get(image.hash)
        if got is not None:
            return got
        job = self.jobs.get(image.hash)
        if job is None:
            job = self.jobs[image.hash] = EncodeJob(self.encoder.pieces(image))
        t0 = time.perf_counter()
        try:
            got = job.run_to(share)
        except Exception:
            del self.jobs[image.hash]  # a failed encoding starts over if asked again
            raise
        job.seconds += time.perf_counter() - t0
        if got is not None:
            self.cache[image.hash] = got
            del self.jobs[image.hash]
            self.seconds.append(job.seconds)
        return got

    def _output(self, image: Any) -> VisionOutput:
        """An image's rows: scheduled to be done by now (or, defensively, finished here)."""
        got = self._advance(image, 1.0)
        assert got is not None
        return got

    def rows(self, out: SchedulerOutput, batch: PackedBatch, states: RequestStates) -> ImageRows | None:
        """The step's image rows; shifts the packed positions of requests with images (rows in
        ``pack``'s order)."""
        decodes, prefills = row_groups(out.chunks)
        ordered = decodes + prefills
        if not any(states[c.request_id].images for c in ordered):
            return None
        rows: list[int] = []
        parts: list[tuple[VisionOutput, int, int]] = []
        pos3 = None
        row = 0
        for c in ordered:
            r = states[c.request_id]
            if r.images:
                p = self.positions.get(c.request_id)
                if p is None:
                    p = self.positions[c.request_id] = self.encoder.positions(r.images)
                at = p.at(c.start, c.num_tokens)
                batch.positions[row:row + c.num_tokens] = at[0]
                for im in r.images:
                    lo, hi = max(c.start, im.offset), min(c.start + c.num_tokens, im.end)
                    if lo < hi:
                        if pos3 is None:
                            pos3 = batch.positions.expand(3, -1).clone()
                        rows.extend(range(row + lo - c.start, row + hi - c.start))
                        parts.append((self._output(im), lo - im.offset, hi - im.offset))
                if pos3 is not None:
                    pos3[:, row:row + c.num_tokens] = at
            row += c.num_tokens
        if self.bidirectional:
            for span, c in zip(batch.meta.prefills, prefills):
                end = c.start + c.num_tokens
                span.blocks = tuple((im.offset, im.end) for im in states[c.request_id].images
                                    if im.overlaps(c.start, end))
        if not rows:
            return None
        embeds = torch.cat([o.embeds[a:b] for o, a, b in parts])
        layers = len(parts[0][0].deepstack)
        deepstack = [torch.cat([o.deepstack[k][a:b] for o, a, b in parts]) for k in range(layers)]
        return ImageRows(torch.tensor(rows, dtype=torch.long), embeds, deepstack, pos3, self.encoder.section)

    def to(self, rows: ImageRows | None, device: torch.device) -> ImageRows | None:
        """The rows on the model's device (positions and indices; the outputs are made there)."""
        if rows is None or device.type == "cpu":
            return rows
        return ImageRows(rows.rows.to(device), rows.embeds, rows.deepstack, rows.rope_positions.to(device),
                         rows.section)
