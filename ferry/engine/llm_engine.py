"""The one step loop: queue -> scheduler -> executor -> update -> outputs."""
from __future__ import annotations

import logging
import uuid
from typing import Any, Callable, Protocol

from ferry.config import EngineConfig
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.outputs import ModelRunnerOutput, SchedulerOutput
from ferry.core.request import Request
from ferry.core.sampling_params import SamplingParams
from ferry.core.scheduler import Scheduler
from ferry.core.static_scheduler import StaticScheduler
from ferry.engine.clock import WallClock
from ferry.engine.detokenizer import IncrementalDetokenizer
from ferry.engine.outputs import RequestOutput
from ferry.engine.step_stats import StepStats

log = logging.getLogger(__name__)


class Executor(Protocol):
    """Turns a scheduler output into sampled tokens (a model, a simulator, a fake)."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput: ...


class LLMEngine:
    """Adds requests, steps them, aborts them. Everything else builds on these three."""

    def __init__(self, config: EngineConfig, executor: Executor, num_kv_blocks: int,
                 tokenizer: Any = None, eos_token_id: int | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.config.check_model_len()
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.clock = clock or WallClock()
        self.kv = KVCacheManager(num_kv_blocks, config.block_size)
        scheduler_cls = StaticScheduler if config.scheduler == "static" else Scheduler
        self.scheduler = scheduler_cls(config, self.kv, self.clock)
        self.step_stats: list[StepStats] = []

    @classmethod
    def from_config(cls, config: EngineConfig, executor: Any = None) -> "LLMEngine":
        """Load the model named by ``config`` (or reuse a loaded ``executor``) and build an engine."""
        if executor is None:
            from ferry.executor.model_executor import ModelExecutor  # torch lives there

            executor = ModelExecutor(config)
        if config.max_model_len is None:
            config.max_model_len = executor.max_model_len
        return cls(config, executor, executor.num_kv_blocks, tokenizer=executor.tokenizer,
                   eos_token_id=executor.eos_token_id)

    # ------------------------------------------------------------------ API
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> Request:
        """Queue one request. Raises ValueError (naming the problem) if it can never be served."""
        sp = sampling_params or SamplingParams()
        text: str | None = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            text = prompt
            # As vLLM does for completions: the tokenizer adds BOS where the model expects one.
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: a request needs at least one prompt token")
        vocab = getattr(self.executor, "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if sp.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to detect them")
        req = Request(
            request_id=request_id if request_id is not None else uuid.uuid4().hex,
            prompt_token_ids=token_ids, sampling_params=sp,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            eos_token_id=self.eos_token_id, priority=priority, prompt=text,
            detokenizer=IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens)
            if self.tokenizer is not None else None)
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> None:
        """Stop a request now; its KV blocks return to the pool at once."""
        self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step; return an output for every request that got a token or finished
        (only those that finished with ``finished_only``: a benchmark needs no stream)."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        start = self.clock()
        try:
            result = self.executor.execute(out)
        except Exception as e:  # the step failed: fail its requests, keep the engine alive
            log.exception("step failed")
            msg = f"{type(e).__name__}: {e}"
            result = ModelRunnerOutput(errors={c.request.request_id: msg for c in out.chunks})
        changed = self.scheduler.update_from_output(out, result)
        self._record_step(out, start)
        return [RequestOutput.from_request(r) for r in changed if r.is_finished or not finished_only]

    def _record_step(self, out: SchedulerOutput, start: float) -> None:
        kinds: dict[str, list[str]] = {"prefill": [], "decode": [], "padding": []}
        tokens = dict.fromkeys(kinds, 0)
        for c in out.chunks:
            if c.padding:
                kind = "padding"
            elif c.num_tokens == 1 and c.start >= c.request.num_prompt_tokens:
                kind = "decode"
            else:
                kind = "prefill"
            kinds[kind].append(c.request.request_id)
            tokens[kind] += c.num_tokens
        self.step_stats.append(StepStats(
            start=start, duration=self.clock() - start, num_prefill_tokens=tokens["prefill"],
            num_decode_tokens=tokens["decode"], num_padding_tokens=tokens["padding"],
            num_requests=len(out.chunks), num_kv_blocks_used=out.num_kv_blocks_used,
            num_preempted=len(out.preempted_req_ids), prefill_ids=tuple(kinds["prefill"]),
            decode_ids=tuple(kinds["decode"]), padding_ids=tuple(kinds["padding"]),
            preempted_ids=tuple(out.preempted_req_ids)))

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

