"""The async front: one background thread runs the step loop; each request gets an async stream.

The engine is not thread-safe, so every touch (add, abort, step) holds one lock.
Adds and aborts run in worker threads (``asyncio.to_thread``) so a long step never
blocks the event loop. Outputs cross back to the loop with ``call_soon_threadsafe``.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol, Sequence

from ferry.core.admission import Admitted
from ferry.core.multimodal import ImageFeature
from ferry.core.sampling_params import SamplingParams
from ferry.engine.live_state import LiveState
from ferry.engine.llm_engine import LLMEngine
from ferry.engine.outputs import RequestOutput

log = logging.getLogger(__name__)
LIVE_LOCK_WAIT_S = 0.1  # how long a dashboard snapshot waits for the step in progress


def check_queueable(num_sequences: int, max_waiting_requests: int | None) -> None:
    """Raise ValueError for a request of more sequences than the server could ever queue."""
    if max_waiting_requests is not None and num_sequences > max_waiting_requests:
        raise ValueError(f"n ({num_sequences} sequences in all, n times the prompts) is more than the server "
                         f"can ever queue (--max-waiting-requests {max_waiting_requests}); send fewer at once")


class StepObserver(Protocol):
    """Watches the step loop (Prometheus metrics, the dashboard's state): attached by whoever
    builds the engine (``AsyncEngine.attach``), called in the step-loop thread under the engine lock."""

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """A step ran (``engine.last_step``: its record, None if it scheduled nothing); ``outputs`` are its outputs."""

    def on_abort(self, n: int) -> None:
        """``n`` requests were aborted by their clients: they leave without a step output."""


class EngineOverloaded(Exception):
    """Too many requests are waiting; the caller should retry later."""


class EngineDead(Exception):
    """The step loop stopped on an unexpected error."""


@dataclass
class SubRequest:
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    token_ids: list[int] | None = None  # the prompt's, when the caller tokenized it already
    images: tuple[ImageFeature, ...] = ()  # the prompt's images (spans of its placeholder tokens)


class Stream:
    """Outputs of one or more engine requests as ``(index, RequestOutput)``, in arrival order.

    Closing it (or leaving ``async for`` early) aborts whatever has not finished.
    """

    def __init__(self, engine: "AsyncEngine", request_ids: list[str]) -> None:
        self.engine = engine
        self.request_ids = request_ids
        self.queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self.unfinished = set(range(len(request_ids)))

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            while self.unfinished:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                index, out = item
                if out.finished:
                    self.unfinished.discard(index)
                yield index, out
        finally:
            await self.close()

    async def close(self) -> None:
        """Abort the requests that have not finished; their KV blocks return at once."""
        left = [self.request_ids[i] for i in self.unfinished]
        self.unfinished.clear()
        for rid in left:
            self.engine.streams.pop(rid, None)
        if left:
            await asyncio.shield(asyncio.to_thread(self.engine.abort_many, left))


class AsyncEngine:
    """Runs ``engine.step()`` in a background thread while requests come and go."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_waiting_requests: int | None = None,
                 observers: Sequence[StepObserver] = ()) -> None:
        """``engine`` is an engine, or a function that builds one: it is then built inside the
        step-loop thread, so that every torch call happens in that one OS thread (a second
        thread's OpenMP team makes small ops several times slower)."""
        self.max_waiting_requests = max_waiting_requests
        # Fed after every step: what the server attaches (``attach``), nothing of the engine's own.
        self.observers: list[StepObserver] = []
        self.live: LiveState | None = None  # the dashboard's state, once attached
        for observer in observers:
            self.attach(observer)
        self._live_pool: ThreadPoolExecutor | None = None
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.started = threading.Event()
        self.streams: dict[str, tuple[Stream, int]] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False
        self.draining = False  # shutting down: no new requests
        self.error: BaseException | None = None
        self._counter = 0
        built = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            try:
                self.engine = engine() if callable(engine) else engine
            except BaseException as e:
                failure.append(e)
                return
            finally:
                built.set()
            self.started.wait()
            self._run()

        self.thread = threading.Thread(target=main, name="ferry-engine", daemon=True)
        self.thread.start()
        built.wait()
        if failure:
            raise failure[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def image_prompter(self) -> Any:
        """The engine's image prompter (``LLMEngine.image_prompter``); None: the model takes no images."""
        return self.engine.image_prompter

    @property
    def max_model_len(self) -> int:
        assert self.engine.config.max_model_len is not None
        return self.engine.config.max_model_len

    def check_text_length(self, chars: int, what: str) -> None:
        """Raise ValueError when ``chars`` characters must be more tokens than max_model_len."""
        self.engine.check_text_length(chars, what)

    def attach(self, observer: StepObserver) -> None:
        """Feed ``observer`` every step from now on (attach before ``start``). A ``LiveState`` also
        answers ``live_state``, the dashboard's."""
        self.observers.append(observer)
        if isinstance(observer, LiveState) and self.live is None:
            self.live = observer

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start stepping (call from the event loop that will consume the streams)."""
        self.loop = asyncio.get_running_loop()
        self.started.set()

    async def stop(self) -> None:
        """Abort everything in flight and stop the step loop."""
        self.abort_all()
        self.stopping = True
        self.wake.set()
        self.started.set()
        await asyncio.to_thread(self.thread.join, 30)
        self._fail_all(EngineDead("the server is shutting down"))
        self.engine.close()
        if self._live_pool is not None:
            self._live_pool.shutdown(wait=False)

    def abort_all(self) -> int:
        """Abort every unfinished request (shutdown). Each stream still open gets its final,
        aborted output, so it can end in good order. Returns how many were aborted."""
        self.draining = True
        with self.lock:
            outputs = [self.engine.abort(rid) for rid in list(self.engine.scheduler.requests)]
            if outputs:
                self._aborted(len(outputs))
        if outputs and self.loop is not None:
            self.loop.call_soon_threadsafe(self._deliver, outputs)
        self.wake.set()
        return len(outputs)

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix between two steps. Returns how many blocks it held."""
        def reset() -> int:
            with self.lock:
                return self.engine.reset_prefix_cache()

        return await asyncio.to_thread(reset)

    async def live_state(self) -> list[dict]:
        """The live dashboard's state: one snapshot per replica (one here), each with a
        ``"replica"`` key, taken in a worker thread; none before a ``LiveState`` is attached. Its
        counts are read between two steps under the engine lock; while a step holds it past
        ``LIVE_LOCK_WAIT_S`` they are those the last step left (a cold prefill step takes seconds,
        and the lock is not first-come first-served)."""
        live = self.live
        if live is None:
            return []

        def take() -> dict:
            if self.lock.acquire(timeout=LIVE_LOCK_WAIT_S):
                try:
                    live.refresh(self.engine)
                finally:
                    self.lock.release()
            return {"replica": "0", **live.snapshot()}

        # A thread of its own, not asyncio.to_thread's pool: submits wait there for the engine lock,
        # and a burst of them would hold the dashboard up for as many steps.
        if self._live_pool is None:
            self._live_pool = ThreadPoolExecutor(1, thread_name_prefix="ferry-live")
        return [await asyncio.get_running_loop().run_in_executor(self._live_pool, take)]

    def num_unfinished(self) -> int:
        with self.lock:
            return len(self.engine.scheduler.requests)

    # ------------------------------------------------------------------ requests
    async def submit(self, subs: list[SubRequest]) -> Stream:
        """Queue every sub-request, or none: a ValueError (bad input) or EngineOverloaded leaves
        the engine untouched. Tokenizing and checking happen before the engine's lock is taken,
        so a large prompt never holds up the step loop."""
        if self.error is not None:
            raise EngineDead(f"the engine stopped: {self.error}")
        await self._grammars_compiled(subs)
        return await asyncio.to_thread(self._submit, subs)

    async def _grammars_compiled(self, subs: list[SubRequest]) -> None:
        """Wait for the grammars of these requests to compile, on the compiler's own threads: no
        worker thread is held meanwhile, so requests without one are never queued behind it."""
        grammars = self.engine.executor.grammars
        if grammars is None:
            return
        from ferry.executor.structured import await_compiled

        specs = {id(s.params.structured_outputs): s.params.structured_outputs for s in subs}
        # All at once: distinct specs compile side by side, and no wait adds up past the bound.
        await asyncio.gather(*(await_compiled(grammars, spec) for spec in specs.values() if spec is not None))

    def _submit(self, subs: list[SubRequest]) -> Stream:
        if self.draining:
            raise EngineOverloaded("the server is shutting down and takes no new requests")
        limit = self.max_waiting_requests
        check_queueable(len(subs), limit)
        engine = self.engine
        token_ids: dict[int, list[int]] = {}  # by prompt object: n copies share one tokenization
        admitted: list[Admitted] = []  # checked here, outside the lock, once each (grammars compiled)
        for sub in subs:
            if id(sub.prompt) not in token_ids:
                token_ids[id(sub.prompt)] = sub.token_ids if sub.token_ids is not None else \
                    engine.tokenize(sub.prompt) if isinstance(sub.prompt, str) else sub.prompt
            admitted.append(engine.admit(token_ids[id(sub.prompt)], sub.params))
        with self.lock:
            sched = engine.scheduler
            if limit is not None and sched.num_waiting + len(subs) > limit:
                raise EngineOverloaded(f"{sched.num_waiting} requests are waiting (the limit is "
                                       f"{limit}); retry later")
            self._counter += 1
            ids = [f"req-{self._counter}-{i}" for i in range(len(subs))]
            stream = Stream(self, ids)
            added: list[str] = []
            try:
                for rid, sub, ok in zip(ids, subs, admitted):
                    engine.add_admitted(ok, request_id=rid, priority=sub.priority,
                                        prompt_text=sub.prompt if isinstance(sub.prompt, str) else None,
                                        images=sub.images)
                    added.append(rid)
            except Exception:
                for rid in added:
                    engine.abort(rid)
                raise
            for i, rid in enumerate(ids):
                self.streams[rid] = (stream, i)
        self.wake.set()
        return stream

    def abort_many(self, request_ids: list[str]) -> None:
        with self.lock:
            aborted = [rid for rid in request_ids if rid in self.engine.scheduler.requests]
            for rid in aborted:
                self.engine.abort(rid)
            if aborted:
                self._aborted(len(aborted))
        self.wake.set()

    # ------------------------------------------------------------------ the step loop
    def _run(self) -> None:
        try:
            while not self.stopping:
                with self.lock:
                    busy = self.engine.has_unfinished()
                    outputs = self.engine.step() if busy else []
                    if busy:
                        for observer in self.observers:
                            observer.on_step(self.engine, outputs)
                if outputs:
                    self.loop.call_soon_threadsafe(self._deliver, outputs)  # type: ignore[union-attr]
                if not busy:
                    self.wake.wait(0.5)
                    self.wake.clear()
        except BaseException as e:  # the loop itself broke (not a model error: those fail their requests)
            log.exception("engine loop died")
            self.error = e
            self.loop.call_soon_threadsafe(self._fail_all, e)  # type: ignore[union-attr]

    def _aborted(self, n: int) -> None:
        for observer in self.observers:
            observer.on_abort(n)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            entry = self.streams.get(out.request_id)
            if entry is None:
                continue  # its stream was closed
            stream, index = entry
            if out.finished:
                del self.streams[out.request_id]
            stream.queue.put_nowait((index, out))

    def _fail_all(self, error: BaseException) -> None:
        for stream, _ in list(self.streams.values()):
            stream.queue.put_nowait(EngineDead(f"the engine stopped: {error}"))
        self.streams.clear()
