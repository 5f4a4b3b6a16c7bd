"""Whether a request can ever be served: every check, in one place, run once per request.

``Admission.check`` runs before a request is queued (``LLMEngine.admit``); the scheduler then
takes it as it is. It reads only settings fixed when the engine was built, so a server runs it
outside the engine's lock, and a refused request leaves the engine untouched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ferry.core.kv_cache_manager import blocks_for
from ferry.core.sampling_params import SamplingParams


def resolve_max_tokens(sp: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """The most tokens a request may generate: its ``max_tokens``, or all the room left."""
    return max_model_len - num_prompt_tokens if sp.max_tokens is None else sp.max_tokens


def no_executor_check(sp: SamplingParams) -> Any:
    """The executor's own check when it has none: nothing to refuse, nothing compiled."""
    return None


@dataclass(frozen=True)
class Admitted:
    """A request that passed every check, ready to queue (``LLMEngine.add_admitted``)."""

    token_ids: list[int]
    sampling_params: SamplingParams
    grammar: Any = None  # compiled by the executor's check, held for the request until it ends


@dataclass(frozen=True)
class Admission:
    """What a request is checked against: the engine's limits, the model's vocabulary, and the
    executor's own check of the sampling settings (it compiles a grammar, or refuses one)."""

    max_model_len: int
    block_size: int
    num_kv_blocks: int
    vocab_size: int | None = None
    has_tokenizer: bool = False
    executor_check: Callable[[SamplingParams], Any] = no_executor_check

    def check(self, token_ids: Sequence[int], sp: SamplingParams) -> Admitted:
        """Raise ValueError, naming the problem, for a request no step could serve; otherwise
        return it admitted (with its compiled grammar, if any)."""
        token_ids = list(token_ids)
        self._check_settings(token_ids, sp)
        grammar = self.executor_check(sp)
        self._check_fits(len(token_ids), sp)
        return Admitted(token_ids, sp, grammar)

    def _check_settings(self, token_ids: list[int], sp: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: a request needs at least one prompt token")
        vocab = self.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if vocab is not None and sp.logit_bias and any(t >= vocab for t in sp.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        room = self.max_model_len - len(token_ids)
        # A prompt that leaves no room at all is refused for its length, by _check_fits.
        if 0 < room < sp.min_tokens:
            raise ValueError(f"min_tokens ({sp.min_tokens}) is more than can ever be generated: the prompt's "
                             f"{len(token_ids)} tokens leave {room} of max_model_len ({self.max_model_len})")
        if sp.stop and not self.has_tokenizer:
            raise ValueError("stop strings need a tokenizer to detect them")

    def _check_fits(self, n_prompt: int, sp: SamplingParams) -> None:
        """The prompt and what it may generate fit max_model_len and the whole KV cache."""
        max_tokens = resolve_max_tokens(sp, n_prompt, self.max_model_len)
        if sp.max_tokens is None and max_tokens < 1:
            raise ValueError(f"prompt has {n_prompt} tokens, which leaves no room to generate "
                             f"within max_model_len ({self.max_model_len})")
        total = n_prompt + max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) is {total} tokens, "
                f"more than max_model_len ({self.max_model_len})")
        need_blocks = blocks_for(total, self.block_size)
        if need_blocks > self.num_kv_blocks:
            raise ValueError(
                f"prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) needs {need_blocks} KV blocks "
                f"of {self.block_size} tokens, more than the whole cache ({self.num_kv_blocks} blocks)")
