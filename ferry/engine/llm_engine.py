"""The one step loop: queue -> scheduler -> executor -> update -> outputs."""
from __future__ import annotations

import logging
import uuid
from collections import deque
from dataclasses import replace
from typing import Any, Callable, MutableSequence, Sequence

from ferry.config import EngineConfig
from ferry.core.admission import Admission, Admitted
from ferry.core.clock import WallClock
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.multimodal import ImageFeature
from ferry.core.outputs import ExecutorDead, ModelRunnerOutput, RequestFailed, SchedulerOutput
from ferry.core.request import Request, RequestStatus
from ferry.core.sampling_params import SamplingParams
from ferry.core.scheduler import Scheduler
from ferry.core.static_scheduler import StaticScheduler
from ferry.engine.draft_lengths import choose_ks
from ferry.engine.output_processor import OutputProcessor
from ferry.engine.outputs import RequestOutput
from ferry.engine.profiler import StepProfiler, no_tick, shape_of
from ferry.engine.step_stats import StepStats
from ferry.executor.base import Executor

log = logging.getLogger(__name__)

STEP_STATS_KEPT = 1000


def tokenize_prompt(text: str, tokenizer: Any, max_model_len: int) -> list[int]:
    """``LLMEngine.tokenize``, for a front that holds a tokenizer but no engine (data parallelism)."""
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
    check_text_length(len(text), "prompt has", max_model_len, tokenizer)
    return tokenizer.encode(text, add_special_tokens=True) if text else []


def check_text_length(chars: int, what: str, max_model_len: int, tokenizer: Any) -> None:
    """Raise ValueError when ``chars`` characters must be more tokens than ``max_model_len``: no
    token is longer than the vocabulary's longest (so a huge text is refused untokenized)."""
    if chars > max_model_len * tokenizer.max_token_chars:
        raise ValueError(f"{what} {chars} characters, so more tokens than max_model_len "
                         f"({max_model_len}) allows")


class LLMEngine:
    """Adds requests, steps them, aborts them. Everything else builds on these three."""

    def __init__(self, config: EngineConfig, executor: Executor, num_kv_blocks: int,
                 tokenizer: Any = None, eos_token_ids: Sequence[int] = (),
                 clock: Callable[[], float] | None = None) -> None:
        if not isinstance(executor, Executor):
            raise TypeError(f"{type(executor).__name__} is not an executor: subclass ferry.executor.base.Executor")
        self.config = config
        self.config.check_model_len()
        self.executor = executor
        self.tokenizer = tokenizer
        # Turns a chat's rendered text and images into a prompt (``ferry.multimodal.processor``);
        # None: the model takes no images. Set by ``from_config`` for a model that does.
        self.image_prompter: Any = None
        self.eos_token_ids = tuple(eos_token_ids)
        self.clock = clock or WallClock()
        # A model whose every layer has a sliding window lets the cache give back what it passed.
        if executor.num_state_slots and config.scheduler == "static":
            raise ValueError("scheduler 'static' does not serve models with recurrent layers: use 'continuous'")
        if executor.num_state_slots and config.speculative_config is not None \
                and config.speculative_config.method != "mtp":
            log.warning("speculative decoding is off for this model: its recurrent layers' state cannot be "
                        "rewound past a rejected draft token")
        self.kv = KVCacheManager(num_kv_blocks, config.block_size,
                                 enable_caching=config.enable_prefix_caching and config.scheduler == "continuous",
                                 window=executor.max_window, num_state_slots=executor.num_state_slots,
                                 snapshot_interval=config.snapshot_interval)
        scheduler_cls = StaticScheduler if config.scheduler == "static" else Scheduler
        self.scheduler = scheduler_cls(config, self.kv, self.clock, whole_images=executor.whole_images,
                                       choose_ks=choose_ks)
        assert config.max_model_len is not None  # the scheduler asserts it too
        self.admission = Admission(config.max_model_len, config.block_size, self.kv.num_blocks,
                                   executor.vocab_size, tokenizer is not None, executor.check_sampling_params)
        self.output_processor = OutputProcessor(tokenizer)
        # The latest steps only: an engine may run for ever. A benchmark that wants every step
        # of a run puts a list here first.
        self.step_stats: MutableSequence[StepStats] = deque(maxlen=STEP_STATS_KEPT)
        # The step that just ran, for observers (metrics, the dashboard); None after a step that
        # scheduled nothing.
        self.last_step: StepStats | None = None
        self.num_failed_requests = 0
        self.profiler: StepProfiler | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, executor: Executor | None = None) -> "LLMEngine":
        """Load the model named by ``config`` (or reuse a loaded ``executor``) and build an engine."""
        if executor is None and config.tensor_parallel_size > 1:
            from ferry.executor.tensor_parallel import TensorParallelExecutor

            executor = TensorParallelExecutor(config)
        elif executor is None:
            from ferry.executor.model_executor import ModelExecutor  # torch lives there

            executor = ModelExecutor(config)
        # Resolved into a new config (the caller's stays as it was): the model's length, and the
        # device and dtype "auto" chose.
        if config.max_model_len is None:
            config = replace(config, max_model_len=executor.max_model_len)
        if executor.device is not None:
            config = replace(config, device=executor.device.type, dtype=executor.dtype_name)
        assert executor.num_kv_blocks is not None, "an executor the engine is sized from sets num_kv_blocks"
        engine = cls(config, executor, executor.num_kv_blocks, tokenizer=executor.tokenizer,
                     eos_token_ids=executor.eos_token_ids)
        engine.image_prompter = executor.image_prompter
        return engine

    # ------------------------------------------------------------------ API
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, prompt_text: str | None = None,
                    images: tuple[ImageFeature, ...] = ()) -> Request:
        """Queue one request; returns its token-level state (the scheduler's). Raises ValueError
        (naming the problem) if it can never be served.

        ``prompt`` is text or token ids; ``prompt_text`` names the text of ids tokenized earlier;
        ``images``: the prompt's images, spans of its placeholder tokens (``image_prompter.encode``).
        (A server tokenizes and admits outside the engine's lock, with ``tokenize`` and
        ``admit``, then queues under it with ``add_admitted``.)
        """
        sp = sampling_params or SamplingParams()
        if isinstance(prompt, str):
            prompt_text, token_ids = prompt, self.tokenize(prompt)
        else:
            token_ids = prompt
        return self.add_admitted(self.admit(token_ids, sp), request_id, arrival_time, priority, prompt_text, images)

    def admit(self, token_ids: Sequence[int], sp: SamplingParams) -> Admitted:
        """Every check a request must pass (``ferry.core.admission``), run once per request: raises
        ValueError naming the problem; returns the request admitted, its grammar compiled. Safe
        to call without holding the engine (it reads only settings): a server admits before queueing."""
        return self.admission.check(token_ids, sp)

    def add_admitted(self, admitted: Admitted, request_id: str | None = None, arrival_time: float | None = None,
                     priority: int = 0, prompt_text: str | None = None,
                     images: tuple[ImageFeature, ...] = ()) -> Request:
        """Queue a request ``admit`` passed (it is not checked again); returns its token-level state."""
        req = Request(
            request_id=request_id if request_id is not None else uuid.uuid4().hex,
            prompt_token_ids=admitted.token_ids, sampling_params=admitted.sampling_params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids, priority=priority, images=tuple(images))
        self.scheduler.add_request(req)
        if admitted.grammar is not None:
            self.executor.hold_grammar(req.request_id, admitted.grammar)
        self.output_processor.add_request(req, prompt_text)
        return req

    def tokenize(self, text: str) -> list[int]:
        """A text prompt's token ids, as vLLM makes them for completions (BOS added where the
        model expects one). A text too long to fit max_model_len whatever it says is refused
        before any of it is tokenized: no token is longer than the longest in the vocabulary."""
        assert self.config.max_model_len is not None
        return tokenize_prompt(text, self.tokenizer, self.config.max_model_len)

    def check_text_length(self, chars: int, what: str) -> None:
        """Raise ValueError when ``chars`` characters must be more tokens than max_model_len."""
        assert self.tokenizer is not None and self.config.max_model_len is not None
        check_text_length(chars, what, self.config.max_model_len, self.tokenizer)

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request now; its KV blocks return to the pool at once. Returns its last output."""
        req = self.scheduler.requests.get(request_id)
        self.scheduler.abort_request(request_id)
        assert req is not None
        return self.output_processor.output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step; return an output for every request that got a token or finished
        (only those that finished with ``finished_only``: a benchmark needs no stream)."""
        prof = self.profiler
        if prof is not None:
            prof.start()
        tick = no_tick if prof is None else prof.tick
        begin = self.clock()
        out = self.scheduler.schedule()
        if out.is_empty:
            self.last_step = None
            return []
        tick("schedule")
        start = self.clock()
        result = self._execute(out)
        changed = self.scheduler.update_from_output(out, result)
        tick("update")
        stats = self._record_step(out, start)
        stats.encoder_seconds = tuple(result.encoder_seconds)
        for req, stop in self.output_processor.take(changed, result):
            self._stopped_by_string(req, stop)
        outputs = self.output_processor.outputs(changed, finished_only)
        stats.wall = self.clock() - begin
        if prof is not None:
            tick("outputs")
            prof.finish(shape_of(out))
            prof.add_images(stats.encoder_seconds, stats.num_encoder_cache_hits)
        return outputs

    def _stopped_by_string(self, req: Request, stop: str) -> None:
        if req.is_finished:  # ended by length on this very token: the stop string wins, as in vLLM
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        else:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED, stop)

    def attach_profiler(self, profiler: StepProfiler | None) -> None:
        """Time every step by part with ``profiler`` from now on (whoever builds the engine makes
        one: ``ferry bench --profile``); None stops."""
        self.profiler = profiler
        self.executor.set_profiler(profiler)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step; if it raises, find the request(s) that make it fail and fail only those.

        A step's requests are independent (each chunk writes only its own KV slots and samples its
        own row, a seeded draw depends only on (seed, token index), and an image's encoding is its
        requests' alone), so re-running a subset of them is the same work as running it in the
        whole step. Halving the failing group until single requests remain isolates the culprit
        in O(log n) retries; the others' results are those of a clean run.
        """
        try:
            return self.executor.execute(out)
        except ExecutorDead:
            raise
        except RequestFailed as e:  # before anything moved: the rest of the step runs without it
            failed = self._fail(e.request_id, e)
            rest = _only(out, set(_request_ids(out)) - {e.request_id})
            if not rest.is_empty:
                failed.update(self._execute(rest))
            return failed
        except Exception as e:
            rids = _request_ids(out)
            if len(rids) == 1:
                return self._fail(rids[0], e)
            if self.executor.num_state_slots:  # a retry would advance recurrent states twice
                return self._fail_all(rids, e)
            log.info("a step of %d requests failed (%s: %s); retrying in smaller groups to find "
                        "the request that causes it", len(rids), type(e).__name__, e)
        result = ModelRunnerOutput()
        groups = [rids]
        while groups:
            group = groups.pop()
            half = len(group) // 2
            try:
                part = self.executor.execute(_only(out, set(group)))
            except ExecutorDead:
                raise
            except Exception as e:
                if len(group) == 1:
                    part = self._fail(group[0], e)
                else:
                    groups += [group[half:], group[:half]]
                    continue
            result.update(part)
        return result

    def _fail_all(self, rids: list[str], e: Exception) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        for rid in rids:
            result.update(self._fail(rid, e))
        return result

    def _fail(self, rid: str, e: Exception) -> ModelRunnerOutput:
        log.error("request %s failed: its step raised %s: %s", rid, type(e).__name__, e,
                  exc_info=(type(e), e, e.__traceback__))
        self.num_failed_requests += 1
        return ModelRunnerOutput(errors={rid: f"{type(e).__name__}: {e}"})

    def _record_step(self, out: SchedulerOutput, start: float) -> StepStats:
        kinds: dict[str, list[str]] = {"prefill": [], "decode": [], "padding": []}
        tokens = dict.fromkeys(kinds, 0)
        for c in out.chunks:
            kind = "padding" if c.padding else "decode" if c.decode else "prefill"
            kinds[kind].append(c.request_id)
            tokens[kind] += c.num_tokens
        s = self.scheduler.take_stats()  # what the scheduler did in this step
        stats = StepStats(
            start=start, duration=self.clock() - start, num_prefill_tokens=tokens["prefill"],
            num_decode_tokens=tokens["decode"], num_padding_tokens=tokens["padding"],
            num_requests=len(out.chunks), num_kv_blocks_used=out.num_kv_blocks_used,
            num_preempted=s.num_preempted, prefill_ids=tuple(kinds["prefill"]),
            decode_ids=tuple(kinds["decode"]), padding_ids=tuple(kinds["padding"]),
            preempted_ids=tuple(out.preempted_req_ids), num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
            num_accepted_tokens=s.num_accepted_tokens, num_prefix_queried_tokens=s.num_prefix_queried_tokens,
            num_prefix_hit_tokens=s.num_prefix_hit_tokens, num_encoder_cache_hits=s.num_encoder_cache_hits)
        stats.shape, stats.num_sampling_rows = out.cost_shape
        self.step_stats.append(stats)
        self.last_step = stats
        return stats

    @property
    def eos_token_id(self) -> int | None:
        """The model's main end-of-sequence token (every id in ``eos_token_ids`` stops a request)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def close(self) -> None:
        """Release what the executor holds outside this process (tensor-parallel ranks)."""
        self.executor.close()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (benchmarks and tests start cold). Returns the blocks it held."""
        return self.scheduler.reset_prefix_cache()


def _request_ids(out: SchedulerOutput) -> list[str]:
    """The requests with work in the step (chunks, then encoder work alone), once each."""
    return list(dict.fromkeys([c.request_id for c in out.chunks] + [r for r, _, _ in out.encoder_inputs]))


def _only(out: SchedulerOutput, rids: set[str]) -> SchedulerOutput:
    """The step with only these requests' chunks and encoder work (a retry that isolates a failure)."""
    return replace(out, chunks=[c for c in out.chunks if c.request_id in rids],
                   encoder_inputs=[e for e in out.encoder_inputs if e[0] in rids])
