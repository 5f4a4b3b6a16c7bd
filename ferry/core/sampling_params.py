"""Per-request sampling settings, validated the way vLLM validates them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Names and meanings follow vLLM. ``temperature == 0`` is greedy decoding.
    ``max_tokens=None`` means "until max_model_len".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not self.temperature >= 0.0:
            raise bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an integer >= 1, or 0/-1 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "an integer in [0, 20]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
