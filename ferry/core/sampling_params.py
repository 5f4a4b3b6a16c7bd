"""Per-request sampling settings, validated the way vLLM validates them."""
from __future__ import annotations

import json as _json  # a StructuredOutputs field is called json
import math
from dataclasses import dataclass, field, replace

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing float32 logits by a
# smaller one can overflow to inf (1e-39, 1e-45 and 1e-300 did: every token was then id 0).
MIN_TEMPERATURE = 1e-5
# How an embedding request pools its prompt's final hidden states (then L2-normalised): the last
# token's (vLLM's default for decoder models) or the mean over every prompt token.
POOLING_TYPES = ("last", "mean")
# vLLM takes a seed as a signed 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


@dataclass
class StructuredOutputs:
    """Constrain a request's output to a grammar (vLLM's structured outputs). Set exactly one of:

    ``json``: a JSON schema (a dict, or its JSON text) the output must validate against;
    ``json_object``: any JSON object; ``regex``: a regular expression the whole output matches;
    ``choice``: the output is one of these strings; ``grammar``: an EBNF grammar in xgrammar's
    syntax (GBNF-like, start rule ``root``, e.g. ``root ::= "yes" | "no"``); ``structural_tag``:
    xgrammar's structural tag (a JSON object: free text where its triggers allow, each tag's
    content constrained once begun; what tool calls under ``tool_choice: auto`` use).
    Checked here for shape only; the executor compiles it when the request arrives.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs: set exactly one of json, json_object, regex, choice, "
                             f"grammar, structural_tag; got {' and '.join(given) if given else 'none'}")

        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"structured_outputs.{name} must be {allowed}, got {getattr(self, name)!r}")

        if isinstance(self.json, str):
            try:
                schema = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise bad("json", "a JSON schema object")
        elif self.json is not None:
            if not isinstance(self.json, dict):
                raise bad("json", "a JSON schema (a dict, or its JSON text)")
            try:
                _json.dumps(self.json)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json: not JSON data: {e}") from None
        if not isinstance(self.json_object, bool):
            raise bad("json_object", "a boolean")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise bad("regex", "a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise bad("choice", "a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise bad("grammar", "a non-empty string")
        if self.structural_tag is not None:
            try:
                tag = _json.loads(self.structural_tag) if isinstance(self.structural_tag, str) else None
            except ValueError as e:
                raise ValueError(f"structured_outputs.structural_tag: not valid JSON: {e}") from None
            if not isinstance(tag, dict):
                raise bad("structural_tag", "a structural tag: the JSON text of an object")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Names and meanings follow vLLM. ``temperature`` below ``MIN_TEMPERATURE`` (0 included) is
    greedy decoding.
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
    prompt_logprobs: int | None = None  # logprobs of the prompt's tokens (the first has none), top n besides
    logit_bias: dict[int, float] | None = None  # added to a token's logit before sampling
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None  # grammar-constrained output
    # Embed the prompt instead of generating: its pooled final hidden states (POOLING_TYPES).
    pooling: str | None = None

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

        def is_int(x: object) -> bool:  # bool is an int to Python, never to a client
            return isinstance(x, int) and not isinstance(x, bool)

        def is_real(x: object) -> bool:  # a finite number: inf and nan would poison the step
            return is_int(x) or (isinstance(x, float) and math.isfinite(x))

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not is_real(getattr(self, name)):
                raise bad(name, "a finite number")
        if not self.temperature >= 0.0:
            raise bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an integer >= 1, or 0/-1 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "an integer in [0, 20]")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", "an integer in [0, 20]")
        if self.logit_bias is not None and any(
                not is_int(t) or t < 0 or not is_real(b) or not -100 <= b <= 100 for t, b in self.logit_bias.items()):
            raise bad("logit_bias", "a map of token ids >= 0 to numbers in [-100, 100]")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"an integer in [{SEED_MIN}, {SEED_MAX}] (a 64-bit generator's seed)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids >= 0")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise bad("structured_outputs", "a StructuredOutputs")
        if self.pooling is not None:
            if self.pooling not in POOLING_TYPES:
                raise bad("pooling", " or ".join(map(repr, POOLING_TYPES)))
            if self.n != 1 or self.structured_outputs is not None or self.logprobs is not None:
                raise ValueError("pooling (an embedding) takes no n, structured_outputs or logprobs")

    def nth(self, k: int) -> "SamplingParams":
        """The k-th of n samples: n=1 and its own seed (when seeded), so samples differ but reproduce."""
        if self.seed is None:
            return replace(self, n=1)
        return replace(self, n=1, seed=(self.seed + k - SEED_MIN) % 2**64 + SEED_MIN)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
