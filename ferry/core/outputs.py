"""What flows between scheduler and executor each step: plain data, no live requests.

A request's token ids and sampling settings cross once, when it is first scheduled
(``NewRequest``); after that each step names only ``(request id, start, num_tokens,
new block ids)``. The executor keeps its own per-request state (tokens it sampled, block
table, grammar matcher) between steps, so a step could run in another thread or process.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

from ferry.core.multimodal import ImageFeature
from ferry.core.sampling_params import SamplingParams


@dataclass
class NewRequest:
    """A request the executor has not seen: sent with the first step that schedules it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    images: tuple[ImageFeature, ...] = ()  # the prompt's images (``Request.images``)


@dataclass(slots=True)
class ScheduledChunk:
    """``num_tokens`` tokens of request ``request_id`` starting at position ``start``.

    ``new_block_ids`` extend the request's block table (after a preemption the table starts
    again from empty). ``samples`` is true when the chunk reaches the end of the request's
    known tokens, so the step yields its next token. ``spec_token_ids`` are draft tokens: the
    chunk's last ``len(spec_token_ids)`` tokens, which the step verifies (each verified row
    samples). A padding chunk (static batching) recomputes a finished request's last token:
    real work, result discarded, counted only in statistics.

    ``decode`` is the one definition of a decode: the chunk runs as one-token query rows over
    context already in the cache (one token, or a verify chunk's ``1 + k``, each its own row).
    The executor packs these rows first; a step of nothing else is a decode step
    (``SchedulerOutput.is_decode_step``: the model's fused path, the profile's "decode" shapes);
    the step's statistics count their tokens as decode tokens.
    """

    request_id: str
    start: int
    num_tokens: int
    new_block_ids: list[int]
    samples: bool
    spec_token_ids: list[int] = field(default_factory=list)
    padding: bool = False
    decode: bool = field(init=False, default=False)
    # Hybrid models: the request's recurrent-state slot, and where its state is kept for the
    # prefix cache after this step (-1: nowhere).
    state_slot: int = -1
    snapshot_slot: int = -1

    def __post_init__(self) -> None:
        # Set once here, not a property: the packer and the step's statistics read it for every chunk.
        self.decode = self.start > 0 and (self.num_tokens == 1 or bool(self.spec_token_ids))

    @property
    def num_sampling_rows(self) -> int:
        return 1 + len(self.spec_token_ids) if self.samples else 0


@dataclass
class SchedulerOutput:
    """One step's boarding list: ``{request_id: num_tokens}`` plus what the executor needs."""

    # Unique in the process (several engines may share one executor); a retry of the same step
    # (failure isolation, ``dataclasses.replace``) carries the same id.
    step_id: int = field(default_factory=itertools.count(1).__next__)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    # The executor forgets these requests' block tables; they come back with new blocks.
    preempted_req_ids: list[str] = field(default_factory=list)
    # Finished since the previous step (by stop, length or abort): the executor drops their state.
    finished_req_ids: list[str] = field(default_factory=list)
    num_kv_blocks_used: int = 0
    # Hybrid models: (snapshot slot, request slot) state copies to make before the step: requests
    # that start from a prefix-cache hit.
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # Images: (request id, image, upto) to run through the vision encoder before the step until
    # ``upto`` of the image's ``length`` tokens' worth of encoding is done (an image's encoding may
    # take several steps, and may start while its request still waits; at ``length`` its output is
    # ready for the step's chunks), and the image hashes whose encoder outputs (or encodings in
    # progress) no chunk will read (dropped first).
    encoder_inputs: list[tuple[str, ImageFeature, int]] = field(default_factory=list)
    freed_encoder_hashes: list[bytes] = field(default_factory=list)

    @property
    def new_req_ids(self) -> list[str]:
        return [r.request_id for r in self.new_requests]

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {c.request_id: c.num_tokens for c in self.chunks}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_padding_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if c.padding)

    @property
    def num_decode_rows(self) -> int:
        """Tokens of the decode chunks (``ScheduledChunk.decode``): one query row each."""
        return sum(c.num_tokens for c in self.chunks if c.decode)

    @property
    def is_decode_step(self) -> bool:
        """A step of decode chunks only (``ScheduledChunk.decode``), padding included: every row a
        one-token query, which the model's fused decode path runs whole."""
        return bool(self.chunks) and all(c.decode for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing to run: no chunk and no encoder work."""
        return not self.chunks and not self.encoder_inputs

    @functools.cached_property
    def cost_shape(self) -> tuple[tuple[tuple[int, int], ...], int]:
        """What the step costs, as the cost model reads it: (num_tokens, start) per chunk, and the
        rows that go through the LM head (one per sampling chunk, ``1 + k`` for a verify chunk;
        padding rows sample nothing). A verify chunk runs as ``1 + k`` decode rows (that is how
        the executor packs it), so it is listed as such: it never counts as a prefill chunk.
        Read by the simulated executor and the step's statistics."""
        chunks: list[tuple[int, int]] = []
        for c in self.chunks:
            if c.spec_token_ids and c.decode:
                chunks.extend([(1, c.start + i) for i in range(c.num_tokens)])
            else:
                chunks.append((c.num_tokens, c.start))
        rows = sum([1 + len(c.spec_token_ids) for c in self.chunks if c.samples and not c.padding])
        return tuple(chunks), rows


@dataclass
class ModelRunnerOutput:
    """Per request that sampled this step: its new tokens (one, or with speculation the accepted
    drafts plus one), and their top logprobs if asked."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # Requests whose computation failed this step: request_id -> error message.
    errors: dict[str, str] = field(default_factory=dict)
    # Prompt logprobs computed this step: request_id -> (index of the first prompt token they
    # score, one entry per consecutive prompt token).
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    # Embedding requests whose prompt ended this step: request_id -> its pooled, normalised vector.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # Image models: the seconds of each image the vision encoder ran this step.
    encoder_seconds: list[float] = field(default_factory=list)

    def update(self, other: "ModelRunnerOutput") -> None:
        """Take in the results of another part of the same step."""
        self.encoder_seconds.extend(other.encoder_seconds)
        self.sampled.update(other.sampled)
        self.logprobs.update(other.logprobs)
        self.errors.update(other.errors)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.pooled.update(other.pooled)


class RequestFailed(RuntimeError):
    """A step's work for one request failed before the step moved any state (an image that would
    not encode): the engine fails that request and runs the rest of the step."""

    def __init__(self, request_id: str, reason: BaseException) -> None:
        super().__init__(f"{type(reason).__name__}: {reason}")
        self.request_id = request_id


class ExecutorDead(RuntimeError):
    """The executor can run no more steps (a tensor-parallel rank died or hung): the engine stops,
    rather than failing request after request on it."""
