"""Several models behind one server: which engines are loaded, their loading, and eviction.

Each model served has an entry. A request that names a model takes a lease on it
(``ModelPool.context``): the model is loaded first if it is not (one load at a time; concurrent
first requests all wait on that one load, each for at most ``load_timeout_s``), and stays loaded
until the request has ended (``ModelLeases``, an ASGI wrapper, gives the lease back). A load that
would pass ``max_loaded`` models or the memory budget first unloads the least recently used model
with no request in flight; while every loaded model is busy it waits for one to free up, within the
same bound. A model unused for ``idle_unload_s`` seconds is unloaded. Each loaded model is its own
engine (``AsyncEngine``: its own scheduler, step thread and metrics) and its own ``ServerContext``.

A server of one model (``ferry serve`` without ``--models-dir``) is a pool of one, loaded at start.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Union

from prometheus_client import CollectorRegistry, Counter, Gauge

from ferry.config import EngineConfig
from ferry.engine.async_engine import AsyncEngine
from ferry.server.errors import APIError
from ferry.server.metrics import metrics_of, observe

if TYPE_CHECKING:
    from ferry.server.context import ServerContext
    from ferry.server.replicas import ReplicaSet

    Front = Union[AsyncEngine, ReplicaSet]

log = logging.getLogger("ferry.models")

LEASES = "ferry.model_leases"  # the ASGI scope's list of the entries a request holds
MODEL = "ferry.model"  # the ASGI scope's name of the model a request picked (its metrics label)
RETRY = {"Retry-After": "5"}
LISTED_NAMES = 50  # an error lists at most this many of the models served


@dataclass(frozen=True)
class PoolSettings:
    """How many models may be loaded at once, and for how long (``ferry serve``'s flags)."""

    max_loaded: int | None = 4  # --max-loaded-models (llama-server's default); None: no cap
    memory_gb: float | None = None  # --models-memory-gb; None: no budget
    idle_unload_s: float | None = None  # --idle-unload-seconds; None: never
    load_timeout_s: float = 300.0  # --model-load-timeout

    def __post_init__(self) -> None:
        for name, flag in (("max_loaded", "max-loaded-models"), ("memory_gb", "models-memory-gb"),
                           ("idle_unload_s", "idle-unload-seconds"), ("load_timeout_s", "model-load-timeout")):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"--{flag} must be > 0, got {value}")

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory_gb is None else int(self.memory_gb * 2**30)


def weights_bytes(config: EngineConfig) -> int:
    """The size of the files a model's weights load from: its GGUF file, or its directory's
    safetensors (ferry's own cache files beside them are not the model's)."""
    from ferry.model.hub import local_model
    from ferry.model.loader import gguf_file

    gguf = gguf_file(config.model)
    if gguf is not None:
        return gguf.stat().st_size
    path = local_model(config.model)  # type: ignore[arg-type]  # None is the embedded GGUF
    return sum(f.stat().st_size for f in path.glob("*.safetensors") if not f.name.startswith("ferry-"))


def estimated_bytes(config: EngineConfig) -> int:
    """A loaded model's memory, as the budget counts it: its weights' files plus its KV cache's budget."""
    return weights_bytes(config) + int(config.kv_cache_memory_gb * 2**30)


def release_memory() -> None:
    """Return an unloaded engine's memory now (its tensors may sit in reference cycles)."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


async def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread of its own: unlike ``asyncio.to_thread``'s pool, a load
    still running when the server shuts down does not hold up its exit."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():  # its awaiter was cancelled (shutdown)
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop has closed: the server has shut down meanwhile
            pass

    threading.Thread(target=run, name="ferry-model-load", daemon=True).start()
    return await done


class LoadFailed(Exception):
    """A model's load raised (its requests get a 500 naming the error)."""


class NoRoom(Exception):
    """Every loaded model stayed busy for the whole wait (503, retry later)."""


@dataclass(eq=False)
class ModelEntry:
    """One model served: its engine settings and, while loaded, its engine and context."""

    name: str
    config: EngineConfig
    front: Any = None  # AsyncEngine (or ReplicaSet) while loaded
    ctx: ServerContext | None = None
    task: asyncio.Task | None = None  # its load in progress
    warm: asyncio.Task | None = None  # its chat template's warm-up
    stopping: bool = False  # being unloaded: its memory is not free yet
    leases: int = 0  # requests in flight on it
    waiting: int = 0  # requests waiting for its load
    last_used: float = 0.0
    loaded_at: float = 0.0
    error: str | None = None  # why its last load failed
    size_bytes: int | None = None  # estimated_bytes, once known

    @property
    def busy(self) -> bool:
        return self.leases > 0 or self.waiting > 0

    @property
    def status(self) -> str:
        """llama-server's router's values: loaded, loading, unloaded (and unloading, failed)."""
        if self.ctx is not None:
            return "loaded"
        if self.task is not None and not self.task.done():
            return "loading"
        if self.stopping:
            return "unloading"
        return "failed" if self.error else "unloaded"


class ModelPool:
    """The models a server serves, loaded on request (see the module's docstring)."""

    def __init__(self, entries: list[ModelEntry], settings: PoolSettings | None = None,
                 build: Callable[[EngineConfig], Front] | None = None, single: bool = False) -> None:
        """``build``: a loaded engine from a model's settings (run in a worker thread; None: the
        models loaded at start cannot be loaded again). ``single``: one model, as a server of one
        model always was: requests may leave ``model`` out, and a wrong one is a 400."""
        names = [e.name for e in entries]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"two models are served as {', '.join(map(repr, twice))}; give each a name of its own")
        if not entries:
            raise ValueError("no model to serve")
        self.entries = {e.name: e for e in entries}
        self.settings = settings or PoolSettings()
        self.build = build
        self.single = single
        self.template: ServerContext | None = None  # each model's context is a copy (``attach``)
        self._one_load = asyncio.Lock()
        self._changed = asyncio.Event()  # a lease given back, or a model unloaded
        self._draining = False
        self._reaper: asyncio.Task | None = None
        self._build_metrics()

    @classmethod
    def of_one(cls, name: str, front: Front, config: EngineConfig | None = None,
               settings: PoolSettings | None = None, build: Callable[[EngineConfig], Front] | None = None) -> ModelPool:
        """A pool of one model, already loaded (a server of one model)."""
        entry = ModelEntry(name, config or EngineConfig(), front=front)
        return cls([entry], settings, build, single=True)

    # ------------------------------------------------------------------ lifecycle
    def attach(self, template: ServerContext) -> None:
        """Each model's context will be ``template`` with its own engine and name (the settings,
        chat template workers and stored responses are shared); the models loaded at start get theirs."""
        self.template = template
        for entry in self.entries.values():
            if entry.front is not None:
                self._adopt(entry, entry.front)

    async def start(self) -> None:
        """Start the engines loaded at start, and the idle unloads (on the server's event loop)."""
        for entry in self.loaded():
            self._run(entry)
            if self.settings.memory_bytes is not None and entry.size_bytes is None:
                entry.size_bytes = await asyncio.to_thread(estimated_bytes, entry.config)
        if self.settings.idle_unload_s is not None:
            self._reaper = asyncio.create_task(self._unload_idle())

    async def stop(self) -> None:
        """Stop every engine (server shutdown)."""
        if self._reaper is not None:
            self._reaper.cancel()
        for entry in self.entries.values():
            if entry.task is not None:
                entry.task.cancel()
            if entry.warm is not None:
                entry.warm.cancel()
        await asyncio.gather(*(entry.front.stop() for entry in self.loaded()))

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        """Shutting down: no new requests, no new loads."""
        self._draining = value
        for entry in self.loaded():
            entry.front.draining = value

    def num_unfinished(self) -> int:
        """Requests in the loaded engines (callable from any thread)."""
        return sum(entry.front.num_unfinished() for entry in self.loaded())

    def abort_all(self) -> int:
        """Abort everything in flight (shutdown); callable from any thread."""
        self._draining = True
        return sum(entry.front.abort_all() for entry in self.loaded())

    # ------------------------------------------------------------------ requests
    def loaded(self) -> list[ModelEntry]:
        """The loaded models, in the order they are served."""
        return [entry for entry in list(self.entries.values()) if entry.front is not None and entry.ctx is not None]

    def entry(self, model: str | None) -> ModelEntry:
        """The entry a request's ``model`` names: a 400 naming ``model`` when it is left out where
        several are served, a 404 listing the models served when it is none of them."""
        if self.single:
            (only,) = self.entries.values()
            if model is None:
                return only
            if model != only.name:  # as a server of one model always answered
                assert self.template is not None
                self.template.check_model(model)
            return only
        if model is None:
            raise APIError(400, f"model is required: this server serves several models ({self.names()})",
                           param="model")
        found = self.entries.get(model)
        if found is None:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.names()}",
                           "not_found_error", param="model", code="model_not_found")
        return found

    def names(self) -> str:
        names = list(self.entries)
        more = f" and {len(names) - LISTED_NAMES} more (GET /v1/models)" if len(names) > LISTED_NAMES else ""
        return ", ".join(map(repr, names[:LISTED_NAMES])) + more

    async def context(self, scope: dict[str, Any], model: str | None) -> ServerContext:
        """The context of the model a request names, loaded first if need be; it stays loaded
        until the request (``scope``) has ended (``ModelLeases`` gives the lease back)."""
        entry = self.entry(model)
        ctx = await self.acquire(entry)
        scope.setdefault(LEASES, []).append(entry)
        scope[MODEL] = entry.name
        return ctx

    async def acquire(self, entry: ModelEntry) -> ServerContext:
        """Take a lease on ``entry``, loading it first if it is not loaded (concurrent callers
        share one load); ``release`` gives the lease back. Waits at most ``load_timeout_s``: then
        a 503 with Retry-After (the load goes on); a 500 naming the error when the load fails."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.load_timeout_s
        entry.waiting += 1  # from now on it is busy: no load evicts it
        try:
            while entry.ctx is None:
                if self._draining:
                    raise APIError(503, "the server is shutting down and takes no new requests",
                                   "server_overloaded", headers={"Retry-After": "1"})
                if entry.task is None or entry.task.done():
                    entry.task = loop.create_task(self._load(entry, deadline))
                    entry.task.add_done_callback(partial(self._load_done, entry))
                try:
                    await asyncio.wait_for(asyncio.shield(entry.task), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise APIError(503, f"model {entry.name!r} is still loading after "
                                   f"{self.settings.load_timeout_s:g} s (--model-load-timeout); retry later",
                                   "server_overloaded", code="model_loading", headers=RETRY) from None
                except NoRoom as e:
                    if loop.time() < deadline:
                        continue  # a load begun for an earlier request gave up: this one may wait longer
                    raise APIError(503, str(e), "server_overloaded", code="model_loading", headers=RETRY) from None
                except LoadFailed as e:
                    raise APIError(500, str(e), "server_error", code="model_load_failed") from None
            entry.leases += 1
            entry.last_used = time.monotonic()
            return entry.ctx
        finally:
            entry.waiting -= 1

    def release(self, entry: ModelEntry) -> None:
        """A lease given back: the request has ended."""
        entry.leases -= 1
        entry.last_used = time.monotonic()
        self._changed.set()

    async def load(self, model: str | None) -> ModelEntry:
        """``POST /models/load``: load a model now (no lease kept)."""
        entry = self.entry(model)
        await self.acquire(entry)
        self.release(entry)
        return entry

    async def unload(self, model: str | None) -> None:
        """``POST /models/unload``: unload a model with no request in flight."""
        entry = self.entry(model)
        if entry.ctx is None:
            raise APIError(400, f"model {entry.name!r} is not loaded ({entry.status})", param="model",
                           code="model_not_loaded")
        if entry.busy:
            raise APIError(409, f"model {entry.name!r} has {entry.leases + entry.waiting} request(s) in "
                           f"flight; unload it once they have finished", param="model", code="model_busy")
        if self.build is None:
            raise APIError(400, f"model {entry.name!r} was loaded at start and could not be loaded again",
                           param="model", code="model_pinned")
        await self._unload(entry, "request")

    # ------------------------------------------------------------------ loading
    async def _load(self, entry: ModelEntry, deadline: float) -> None:
        """Load ``entry`` (one load at a time), first unloading what it needs room from."""
        async with self._one_load:
            if entry.ctx is not None or not entry.waiting:
                return  # loaded meanwhile, or no request waits for it any more
            try:
                if self.build is None:
                    raise LoadFailed(f"model {entry.name!r} was loaded at start and cannot be loaded again")
                budget = self.settings.memory_bytes
                if budget is not None and entry.size_bytes is None:
                    entry.size_bytes = await asyncio.to_thread(estimated_bytes, entry.config)
                if budget is not None and entry.size_bytes is not None and entry.size_bytes > budget:
                    raise LoadFailed(f"model {entry.name!r} needs about {entry.size_bytes / 2**30:.2f} GiB "
                                     f"(weights and KV cache), more than --models-memory-gb "
                                     f"{self.settings.memory_gb:g}")
                await self._make_room(entry, deadline)
                log.info("loading model %r", entry.name)
                began = time.monotonic()
                front = await in_daemon_thread(self.build, entry.config)
            except (NoRoom, asyncio.CancelledError):
                raise
            except Exception as e:  # noqa: BLE001 - whatever it is, its requests hear of it
                message = str(e) if isinstance(e, LoadFailed) else f"model {entry.name!r} failed to load: {e}"
                entry.error = message
                self.load_failures.labels(entry.name).inc()
                log.error("%s", message)
                raise LoadFailed(message) from e
            self._adopt(entry, front)
            self._run(entry)
            log.info("loaded model %r in %.1f s (%d loaded)", entry.name, time.monotonic() - began,
                     len(self.loaded()))

    @staticmethod
    def _load_done(entry: ModelEntry, task: asyncio.Task) -> None:
        if entry.task is task:
            entry.task = None
        if not task.cancelled():
            task.exception()  # its waiters answered it; nobody else need hear of it

    def _adopt(self, entry: ModelEntry, front: Front) -> None:
        """``front`` is ``entry``'s engine from now on: its metrics, its context."""
        assert self.template is not None, "attach() first"
        if isinstance(front, AsyncEngine):
            observe(front, entry.name)
        if self._draining:
            front.draining = True
        entry.front = front
        entry.ctx = replace(self.template, engine=front, model_name=entry.name)
        entry.error = None
        entry.loaded_at = entry.last_used = time.monotonic()
        self.loads.labels(entry.name).inc()

    def _run(self, entry: ModelEntry) -> None:
        """Start ``entry``'s step loop, and ready its chat template in the background."""
        assert entry.ctx is not None
        entry.front.start()
        entry.warm = asyncio.create_task(entry.ctx.start_renders())

    def _fits(self, entry: ModelEntry) -> bool:
        """Whether ``entry`` can load beside the models loaded (or still unloading)."""
        held = [e for e in self.entries.values() if (e.ctx is not None or e.stopping) and e is not entry]
        limit, budget = self.settings.max_loaded, self.settings.memory_bytes
        if limit is not None and len(held) >= limit:
            return False
        return budget is None or sum(e.size_bytes or 0 for e in held) + (entry.size_bytes or 0) <= budget

    def _least_recently_used(self) -> ModelEntry | None:
        idle = [e for e in self.loaded() if not e.busy]
        return min(idle, key=lambda e: e.last_used) if idle and self.build is not None else None

    async def _make_room(self, entry: ModelEntry, deadline: float) -> None:
        """Unload least recently used idle models until ``entry`` fits; while every loaded model
        is busy, wait for one to free up, until ``deadline`` (then NoRoom)."""
        loop = asyncio.get_running_loop()
        while not self._fits(entry):
            victim = self._least_recently_used()
            if victim is not None:
                await self._unload(victim, "evicted")
                continue
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise NoRoom(f"model {entry.name!r} cannot load: every loaded model "
                             f"({', '.join(repr(e.name) for e in self.loaded())}) has requests in flight "
                             f"(--max-loaded-models / --models-memory-gb); retry later") from None

    async def _unload(self, entry: ModelEntry, reason: str) -> None:
        """Stop ``entry``'s engine and let its memory go (``reason``: evicted, idle, request)."""
        front, warm = entry.front, entry.warm
        entry.front = entry.ctx = entry.warm = None  # no new lease from here on
        entry.stopping = True
        if warm is not None:
            warm.cancel()
        try:
            await front.stop()
        finally:
            del front
            await asyncio.to_thread(release_memory)
            entry.stopping = False
            self.unloads.labels(entry.name).inc()
            if reason == "evicted":
                self.evictions.labels(entry.name).inc()
            self._changed.set()
        log.info("unloaded model %r (%s; %d loaded)", entry.name, reason, len(self.loaded()))

    async def _unload_idle(self) -> None:
        """Unload each model unused for ``idle_unload_s`` seconds."""
        idle_s = self.settings.idle_unload_s
        assert idle_s is not None
        while True:
            await asyncio.sleep(min(1.0, idle_s / 4))
            now = time.monotonic()
            for entry in self.loaded():
                if not entry.busy and now - entry.last_used >= idle_s and self.build is not None:
                    try:
                        await self._unload(entry, "idle")
                    except Exception:  # noqa: BLE001 - one engine's failing stop must not end the unloads
                        log.exception("unloading model %r failed", entry.name)

    # ------------------------------------------------------------------ what the server reports
    def engine_error(self) -> BaseException | None:
        """A server of one model: its engine's error, which fails /health as it always did (with
        several models, one that fails fails only its own requests)."""
        if not self.single:
            return None
        loaded = self.loaded()
        return loaded[0].front.error if loaded else None

    def card(self, entry: ModelEntry) -> dict[str, Any]:
        """``entry`` in /v1/models: OpenAI's fields, and llama-server's ``status``."""
        card: dict[str, Any] = {"id": entry.name, "object": "model", "created": int(time.time()), "owned_by": "ferry"}
        if entry.ctx is not None:
            card["max_model_len"] = entry.ctx.max_model_len
        status: dict[str, Any] = {"value": entry.status}
        if entry.status == "failed":
            status["error"] = entry.error
        card["status"] = status
        return card

    async def reset_prefix_cache(self) -> int:
        return sum([await entry.front.reset_prefix_cache() for entry in self.loaded()])

    def _first_loaded(self) -> ModelEntry | None:
        loaded = self.loaded()
        return min(loaded, key=lambda e: e.loaded_at) if loaded else None

    async def live_state(self) -> list[dict[str, Any]]:
        """The dashboard's state: the first loaded model's (none while none is loaded)."""
        first = self._first_loaded()
        return await first.front.live_state() if first is not None else []

    def dashboard_model(self) -> str:
        first = self._first_loaded()
        return first.name if first is not None else ""

    def _build_metrics(self) -> None:
        self.registry = r = CollectorRegistry()
        Gauge("ferry:models_loaded", "Models loaded (each its own engine).", registry=r).set_function(
            lambda: len(self.loaded()))
        loaded = Gauge("ferry:model_loaded", "1 while the model is loaded, else 0.", ["model_name"], registry=r)
        self.loads = Counter("ferry:model_loads", "Loads of the model.", ["model_name"], registry=r)
        self.unloads = Counter("ferry:model_unloads", "Unloads of the model (evicted, idle or asked for).",
                               ["model_name"], registry=r)
        self.evictions = Counter("ferry:model_evictions", "Unloads of the model to make room for another.",
                                 ["model_name"], registry=r)
        self.load_failures = Counter("ferry:model_load_failures", "Loads of the model that failed.",
                                     ["model_name"], registry=r)
        for entry in self.entries.values():  # every model's samples, at 0 until something happens
            loaded.labels(entry.name).set_function(lambda e=entry: float(e.ctx is not None))
            for counter in (self.loads, self.unloads, self.evictions, self.load_failures):
                counter.labels(entry.name)

    async def prometheus(self) -> bytes:
        """Every loaded engine's metrics (each labelled with its model), merged as the
        data-parallel replicas' are, and the pool's own."""
        from ferry.server.replicas import merged_exposition

        groups, text = [], b""
        for entry in self.loaded():
            if isinstance(entry.front, AsyncEngine):
                metrics = metrics_of(entry.front)
                if metrics is not None:
                    groups.append(list(metrics.registry.collect()))
            else:  # data-parallel replicas: merged by their front already
                text += await entry.front.prometheus()
        return text + merged_exposition(groups + [list(self.registry.collect())])


class ModelLeases:
    """ASGI wrapper: gives back the leases a request took on models (``ModelPool.context``) once
    its response has been sent, a stream's last event included, or its client has left."""

    def __init__(self, app: Any, pool: ModelPool) -> None:
        self.app = app
        self.pool = pool

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        leases: list[ModelEntry] = []
        scope[LEASES] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            for entry in leases:
                self.pool.release(entry)


def model_pool(request: Any) -> ModelPool:
    """The app's models, from inside a route."""
    return request.app.state.models
