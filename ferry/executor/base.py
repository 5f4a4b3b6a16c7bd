"""The executor's contract: everything the engine uses of an executor, in one class.

An executor turns a scheduler output into sampled tokens: a model (``model_executor.py``), its
tensor-parallel driver (``tensor_parallel.py``), a cost model (``simulated.py``), a test's fake.
Each subclasses ``Executor``; the engine reads these attributes and calls these methods directly,
so a new executor sees here all it must (``execute``) or may (the rest) provide.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

from ferry.core.outputs import ModelRunnerOutput, SchedulerOutput
from ferry.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from ferry.executor.structured import GrammarCompiler
    from ferry.model.config import ModelConfig


class StepTimer(Protocol):
    """What times the parts of a step (``ferry.engine.profiler.StepProfiler``), as an executor
    and its model report them."""

    def tick(self, part: str) -> None:
        """The part ``part`` ends now (it began at the previous tick)."""

    def split(self, parts: dict[str, float], rest: str) -> None:
        """A stretch timed by its own code ends now: ``parts`` seconds to their parts, the rest to ``rest``."""


def no_tick(part: str) -> None:
    """The tick of a step that is not profiled."""


class Executor(ABC):
    """What the engine uses of an executor. Only ``execute`` is required; every other member has
    the default of an executor without that feature (no model, no grammars, nothing to close)."""

    # Read once, when the engine is built. An executor that ``LLMEngine.from_config`` sizes the
    # engine from sets max_model_len, num_kv_blocks, tokenizer and eos_token_ids.
    max_model_len: int | None = None  # the model's context length, resolved for this engine
    num_kv_blocks: int | None = None  # KV-cache blocks the executor holds
    # Recurrent-state slots it holds (models with recurrent layers; 0: none). A failed step of such
    # a model is not retried in parts: its states may have moved on already.
    num_state_slots: int = 0
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None  # None: token ids are not checked against a vocabulary
    model_config: ModelConfig | None = None
    device: torch.device | None = None  # None: the engine's settings keep the device and dtype asked for
    dtype_name: str | None = None
    # Structured outputs: the compiler whose grammars ``check_sampling_params`` returns (a server
    # awaits their compiles off the engine's lock), or None.
    grammars: GrammarCompiler | None = None
    # An image model's prompter (expands image placeholders, runs its image processor); None: text only.
    image_prompter: Any = None

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: each chunk's tokens through the model, a token sampled where it samples.
        Raises ``ExecutorDead`` when no step can ever run again; any other exception fails the
        step's requests (the engine retries them in smaller groups to find the one at fault)."""

    @property
    def max_window(self) -> int | None:
        """The attention window when every layer of the model has one (the KV cache then gives
        back what every layer has passed), else None."""
        return None if self.model_config is None else self.model_config.max_window

    @property
    def whole_images(self) -> bool:
        """Whether a prompt chunk must hold each image it touches whole: the model attends an
        image's tokens both ways in prefill (``Architecture.bidirectional_images``)."""
        return self.model_config is not None and self.model_config.arch.bidirectional_images

    def check_sampling_params(self, sp: SamplingParams) -> Any:
        """Raise ValueError (naming the field) if ``sp`` cannot be served; compiles its grammar
        and returns it (for ``hold_grammar``), or None."""
        return None

    def hold_grammar(self, request_id: str, compiled: Any) -> None:
        """Keep a queued request's compiled grammar until it ends (the cache may drop it meanwhile)."""

    def set_profiler(self, profiler: StepTimer | None) -> None:
        """Report the parts of each step to ``profiler`` (None: stop)."""

    def close(self) -> None:
        """Release what the executor holds outside this process (tensor-parallel ranks)."""


class WrappedExecutor(Executor):
    """Runs ``inner``'s steps, to watch or change them (a subclass overrides ``execute``); every
    other member of the contract is ``inner``'s."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.max_model_len, self.num_kv_blocks = inner.max_model_len, inner.num_kv_blocks
        self.num_state_slots = inner.num_state_slots
        self.tokenizer, self.eos_token_ids, self.vocab_size = inner.tokenizer, inner.eos_token_ids, inner.vocab_size
        self.model_config, self.device, self.dtype_name = inner.model_config, inner.device, inner.dtype_name
        self.grammars = inner.grammars
        self.image_prompter = inner.image_prompter

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.inner.execute(out)

    @property
    def whole_images(self) -> bool:
        return self.inner.whole_images

    def check_sampling_params(self, sp: SamplingParams) -> Any:
        return self.inner.check_sampling_params(sp)

    def hold_grammar(self, request_id: str, compiled: Any) -> None:
        self.inner.hold_grammar(request_id, compiled)

    def set_profiler(self, profiler: StepTimer | None) -> None:
        self.inner.set_profiler(profiler)

    def close(self) -> None:
        self.inner.close()
