"""Data parallelism: N engine replicas as Ray actors behind one OpenAI-compatible endpoint.

Each replica is a Ray actor holding a whole engine (``AsyncEngine`` on its own model copy, its
own metrics and dashboard state). The server's process holds no model: ``ReplicaSet`` tokenizes
each request, asks the router (``router.py``) which replica serves it, submits it there and
relays that replica's outputs into the request's stream. One long poll per replica brings back
every output that replica produced since the last one, so a step's outputs cross in one message.

A replica that dies (its actor's process is gone): the router stops sending it traffic; its
requests that have streamed nothing yet are submitted again elsewhere, the others end with an
error naming the replica; the endpoint keeps serving on the replicas left.
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

from ferry.config import EngineConfig
from ferry.engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded, Stream, SubRequest, check_queueable
from ferry.engine.llm_engine import check_text_length, tokenize_prompt
from ferry.engine.outputs import RequestOutput
from ferry.server.router import NoReplicaAlive, Router, RouterConfig

log = logging.getLogger(__name__)

POLL_S = 1.0  # a replica's long poll returns after this even with nothing to say
CALL_TIMEOUT_S = 10.0  # metrics, state, reset: a replica that takes longer is skipped this time


class ReplicaWorker:
    """One replica, run as a Ray actor (``ray.remote(ReplicaWorker)``); its methods are async,
    so Ray runs them on the actor's event loop while the engine steps in its own thread."""

    def __init__(self, config: EngineConfig, index: int, model_name: str, max_waiting_requests: int | None) -> None:
        from ferry.engine.llm_engine import LLMEngine
        from ferry.server.metrics import observe

        self.index = str(index)
        self.engine = AsyncEngine(lambda: LLMEngine.from_config(config), max_waiting_requests)
        self.metrics = observe(self.engine, model_name, replica=self.index)
        # Outputs are cumulative (text and tokens so far): only the latest per sub-request crosses.
        self.outbox: dict[tuple[str, int], RequestOutput | str] = {}
        self.pumps: dict[str, asyncio.Task] = {}
        self.has_output: asyncio.Event | None = None

    async def ready(self) -> dict[str, Any]:
        """Start stepping (on this actor's loop); what the front needs to know of the engine."""
        self.engine.start()
        self.has_output = asyncio.Event()
        llm = self.engine.engine
        return {"max_model_len": llm.config.max_model_len, "num_kv_blocks": llm.num_kv_blocks,
                "block_size": llm.config.block_size, "pid": os.getpid()}

    async def submit(self, key: str, subs: list[SubRequest]) -> None:
        """Queue a request's sub-requests (raises what ``AsyncEngine.submit`` raises, for the
        front to answer with); their outputs come back through ``poll`` under ``key``."""
        stream = await self.engine.submit(subs)
        self.pumps[key] = asyncio.create_task(self._pump(key, stream))

    async def _pump(self, key: str, stream: Stream) -> None:
        try:
            async for i, out in stream:
                self._post((key, i, out))
        except EngineDead as e:
            self._post((key, -1, str(e)))
        finally:
            self.pumps.pop(key, None)

    def _post(self, item: tuple[str, int, RequestOutput | str]) -> None:
        key, i, out = item
        self.outbox.pop((key, i), None)  # re-inserted last: the order of the newest outputs
        self.outbox[(key, i)] = out
        assert self.has_output is not None
        self.has_output.set()

    async def poll(self, timeout: float = POLL_S) -> tuple[list[tuple[str, int, RequestOutput | str]], float]:
        """Every output since the last poll (waiting up to ``timeout`` for one), and the KV usage."""
        assert self.has_output is not None
        if not self.outbox:
            try:
                await asyncio.wait_for(self.has_output.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        items, self.outbox = [(key, i, out) for (key, i), out in self.outbox.items()], {}
        self.has_output.clear()
        return items, self.engine.engine.kv.usage

    async def abort(self, key: str) -> None:
        """The client left: abort the request's unfinished sub-requests."""
        task = self.pumps.pop(key, None)
        if task is not None:
            task.cancel()  # leaving the stream's loop closes it, which aborts what is unfinished

    async def abort_all(self) -> int:
        return await asyncio.to_thread(self.engine.abort_all)  # it waits for the engine's lock

    async def metric_families(self) -> list[Any]:
        """This replica's Prometheus metric families (labelled ``replica``), for the front to merge."""
        return list(self.metrics.registry.collect())

    async def live_state(self) -> dict[str, Any]:
        state = (await self.engine.live_state())[0]
        return {**state, "replica": self.index, "pid": os.getpid()}

    async def reset_prefix_cache(self) -> int:
        return await self.engine.reset_prefix_cache()

    async def shutdown(self) -> None:
        await self.engine.stop()


@dataclass(eq=False)
class _Group:
    """The sub-requests of one API request, all on one replica."""

    key: str
    subs: list[SubRequest]  # tokenized: each has its token_ids
    stream: "_ReplicaStream | None" = None
    replica: int = -1
    started: bool = False  # something was streamed: it can no longer move to another replica
    placing: bool = False  # being submitted: _place itself handles its replica dying
    done: set[int] = field(default_factory=set)

    @property
    def token_ids(self) -> list[int]:
        """The prompt the router reads (the group's sub-requests share it)."""
        return self.subs[0].token_ids or []


class _ReplicaStream(Stream):
    """A request's stream at the front; closing it aborts the request on its replica."""

    def __init__(self, front: "ReplicaSet", key: str, n: int) -> None:
        super().__init__(front, [f"{key}-{i}" for i in range(n)])  # type: ignore[arg-type]
        self.key = key

    async def close(self) -> None:
        if self.unfinished:
            self.unfinished.clear()
            self.engine._end(self.key, abort=True)  # type: ignore[attr-defined]


class ReplicaSet:
    """The front ``build_app`` serves when there are several replicas: the same methods as
    AsyncEngine (submit, reset_prefix_cache, live_state, start, stop, ...), and ``prometheus``."""

    def __init__(self, config: EngineConfig, num_replicas: int, router: RouterConfig, model_name: str,
                 max_waiting_requests: int | None = None, ray_address: str | None = None) -> None:
        import ray

        from ferry.model.device import resolve_device
        from ferry.model.loader import resolve_model_dir
        from ferry.model.tokenizer import load_tokenizer

        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
        self._ray_started = not ray.is_initialized()
        if self._ray_started:
            # address None starts a local cluster (or joins the one RAY_ADDRESS names); "auto" or
            # host:port joins an existing one.
            ray.init(address=ray_address, include_dashboard=False, logging_level=logging.WARNING,
                     log_to_driver=True)
        cpus = ray.cluster_resources().get("CPU", 1)
        local = ray_address is None
        if local and not config.num_threads:  # the cores shared out, not every replica on all of them
            config = replace(config, num_threads=max(1, int(cpus) // num_replicas))
        # A replica on CUDA asks Ray for its GPUs (one per tensor-parallel rank), so each gets its own.
        gpus = config.tensor_parallel_size if resolve_device(config.device).type == "cuda" else 0
        worker = ray.remote(ReplicaWorker).options(num_cpus=min(1.0, cpus / num_replicas), num_gpus=gpus,
                                                   max_concurrency=1000)
        self.actors = [worker.remote(config, i, model_name, max_waiting_requests) for i in range(num_replicas)]
        self.infos = ray.get([a.ready.remote() for a in self.actors])
        self.tokenizer = load_tokenizer(resolve_model_dir(config.model, config.cache_dir, floats=False))
        self.max_model_len = self.infos[0]["max_model_len"]
        self.max_waiting_requests = max_waiting_requests
        router = replace(router, block_size=self.infos[0]["block_size"],
                         cached_blocks_per_replica=self.infos[0]["num_kv_blocks"])
        self.router = Router(num_replicas, router)
        self.model_name = model_name
        self.groups: dict[str, _Group] = {}
        self.error: BaseException | None = None
        self.draining = False
        self.stopping = False
        self._counter = 0
        self._pollers: list[asyncio.Task] = []
        self._tasks: set[asyncio.Task] = set()  # retries in flight (kept: the loop holds tasks weakly)
        self._build_metrics()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._pollers = [asyncio.create_task(self._poll(r)) for r in range(len(self.actors))]

    async def stop(self) -> None:
        import ray

        self.abort_all()
        # The aborted requests' last outputs come back through the pollers: give them a moment.
        for _ in range(40):
            if not self.groups:
                break
            await asyncio.sleep(0.05)
        self.stopping = True
        alive = [self.actors[r] for r in self.router.alive()]
        try:
            await asyncio.wait_for(asyncio.gather(*[a.shutdown.remote() for a in alive], return_exceptions=True),
                                   30)
        except asyncio.TimeoutError:
            log.warning("replicas did not stop in 30 s; killing them")
        for task in self._pollers:
            task.cancel()
        for a in self.actors:
            ray.kill(a)
        for group in list(self.groups.values()):
            self._fail(group, EngineDead("the server is shutting down"))
        if self._ray_started:
            ray.shutdown()

    def abort_all(self) -> int:
        """Abort everything in flight (shutdown); callable from any thread."""
        self.draining = True
        n = len(self.groups)
        for r in self.router.alive():
            self.actors[r].abort_all.remote()
        return n

    def num_unfinished(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------------ requests
    async def submit(self, subs: list[SubRequest]) -> Stream:
        """Tokenize, route, queue on the chosen replica; raises as AsyncEngine.submit does."""
        if self.error is not None:
            raise EngineDead(f"the engine stopped: {self.error}")
        if self.draining:
            raise EngineOverloaded("the server is shutting down and takes no new requests")
        check_queueable(len(subs), self.max_waiting_requests)
        subs = await asyncio.to_thread(self._tokenize, subs)
        self._counter += 1
        group = _Group(f"req-{self._counter}", subs)
        group.stream = _ReplicaStream(self, group.key, len(subs))
        self.groups[group.key] = group
        try:
            await self._place(group, frozenset())
        except NoReplicaAlive as e:
            self.groups.pop(group.key, None)
            raise EngineDead(str(e)) from None
        except BaseException:
            self.groups.pop(group.key, None)
            raise
        return group.stream

    def _tokenize(self, subs: list[SubRequest]) -> list[SubRequest]:
        """Token ids for every prompt (the router reads them; the replica checks them), once per
        distinct prompt."""
        ids: dict[int, list[int]] = {}
        out = []
        for sub in subs:
            if id(sub.prompt) not in ids:
                p = sub.prompt
                ids[id(p)] = tokenize_prompt(p, self.tokenizer, self.max_model_len) if isinstance(p, str) else list(p)
            out.append(replace(sub, token_ids=ids[id(sub.prompt)]))
        return out

    def check_text_length(self, chars: int, what: str) -> None:
        check_text_length(chars, what, self.max_model_len, self.tokenizer)

    async def _place(self, group: _Group, exclude: frozenset[int]) -> None:
        """Route the group and submit it; a replica found dead on the way is skipped. Errors the
        replica raises about the request itself (ValueError, EngineOverloaded) reach the caller."""
        from ray.exceptions import RayActorError, RayTaskError

        while True:
            r = self.router.route(group.token_ids, exclude)  # NoReplicaAlive when none is left
            group.replica, group.placing = r, True
            try:
                await self.actors[r].submit.remote(group.key, group.subs)
            except RayTaskError as e:
                self.router.finished(r)
                cause = getattr(e, "cause", None)
                if isinstance(cause, EngineDead):  # that replica's engine stopped: it serves no more
                    self._replica_died(r, cause)
                    exclude = exclude | {r}
                    continue
                raise cause if isinstance(cause, (ValueError, EngineOverloaded)) else EngineDead(str(e))
            except RayActorError as e:
                self.router.finished(r)
                self._replica_died(r, e)
                exclude = exclude | {r}
                continue
            except BaseException:
                self.router.finished(r)
                raise
            finally:
                group.placing = False
            if group.key not in self.groups:  # its client left while it was being submitted
                self.router.finished(r)
                self.actors[r].abort.remote(group.key)
            return

    def _end(self, key: str, abort: bool = False) -> None:
        group = self.groups.pop(key, None)
        if group is None:
            return
        self.router.finished(group.replica)
        if abort and self.router.replicas[group.replica].alive:
            self.actors[group.replica].abort.remote(key)

    def _fail(self, group: _Group, error: BaseException) -> None:
        self._end(group.key)
        assert group.stream is not None
        group.stream.queue.put_nowait(error)

    # ------------------------------------------------------------------ outputs
    async def _poll(self, r: int) -> None:
        from ray.exceptions import RayActorError

        actor = self.actors[r]
        while not self.stopping and self.router.replicas[r].alive:
            try:
                items, usage = await actor.poll.remote(POLL_S)
            except RayActorError as e:
                self._replica_died(r, e)
                return
            except Exception as e:  # noqa: BLE001 - a broken replica must not stop the others' relays
                log.exception("replica %d: poll failed", r)
                self._replica_died(r, e)
                return
            self.router.report(r, usage)
            for key, i, out in items:
                group = self.groups.get(key)
                if group is None or group.replica != r:
                    continue  # its client left, or it moved on
                if isinstance(out, str):  # the replica's engine stopped: the replica is lost
                    self._replica_died(r, EngineDead(out))
                    return
                group.started = True
                assert group.stream is not None
                group.stream.queue.put_nowait((i, out))
                if out.finished:
                    group.done.add(i)
                    if len(group.done) == len(group.subs):
                        self._end(key)

    def _replica_died(self, r: int, error: BaseException) -> None:
        """No more traffic to replica ``r``; what it held moves (nothing streamed yet) or fails."""
        import ray

        if not self.router.replicas[r].alive:
            return
        log.error("replica %d died (%s: %s): no more traffic goes there", r, type(error).__name__, error)
        self.router.mark_dead(r)
        ray.kill(self.actors[r])  # an actor whose engine stopped is alive, but serves nothing
        if not self.router.alive():
            self.error = RuntimeError("every replica has died")
        for group in [g for g in self.groups.values() if g.replica == r and not g.placing]:
            if group.started or self.error is not None:
                self._fail(group, EngineDead(f"replica {r} died while serving the request"))
            else:  # nothing streamed yet: serve it elsewhere
                self.router.finished(r)
                task = asyncio.get_running_loop().create_task(self._retry(group, r))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _retry(self, group: _Group, dead: int) -> None:
        try:
            await self._place(group, frozenset({dead}))
        except Exception as e:  # noqa: BLE001 - whatever it is, the client hears of it
            self.groups.pop(group.key, None)
            assert group.stream is not None
            group.stream.queue.put_nowait(e if isinstance(e, EngineDead) else EngineDead(
                f"replica {dead} died and the request could not move: {e}"))

    # ------------------------------------------------------------------ state
    async def _each(self, method: str) -> list[Any]:
        """``method`` on every live replica, by replica; None where it failed or took too long."""
        alive = self.router.alive()
        calls = [asyncio.wait_for(getattr(self.actors[r], method).remote(), CALL_TIMEOUT_S) for r in alive]
        results = await asyncio.gather(*calls, return_exceptions=True)
        out: list[Any] = [None] * len(self.actors)
        for r, res in zip(alive, results):
            out[r] = None if isinstance(res, BaseException) else res
        return out

    async def reset_prefix_cache(self) -> int:
        return sum(n or 0 for n in await self._each("reset_prefix_cache"))

    async def live_state(self) -> list[dict[str, Any]]:
        states = await self._each("live_state")
        out = []
        for r, state in enumerate(states):
            view = self.router.replicas[r]
            extra = {"alive": view.alive, "routed": view.num_routed, "in_flight": view.num_requests}
            out.append({**state, **extra} if state is not None else {"replica": str(r), **extra})
        return out

    def _build_metrics(self) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.registry = CollectorRegistry()
        labels = ["model_name", "replica"]
        up = Gauge("ferry:replica_up", "1 while the replica is alive and routed to, 0 once it died.", labels,
                   registry=self.registry)
        routed = Gauge("ferry:router_requests_routed", "Requests the router sent to the replica so far.", labels,
                       registry=self.registry)
        for r, view in enumerate(self.router.replicas):
            up.labels(self.model_name, str(r)).set_function(lambda v=view: float(v.alive))
            routed.labels(self.model_name, str(r)).set_function(lambda v=view: float(v.num_routed))

    async def prometheus(self) -> bytes:
        """Every replica's metrics, each sample labelled with its replica, plus the router's."""
        return merged_exposition([*await self._each("metric_families"), list(self.registry.collect())])


def merged_exposition(groups: list[list[Any] | None]) -> bytes:
    """Prometheus' text of metric families collected from several registries (replicas, or the
    models of a server of several): the samples of one name under one HELP and TYPE."""
    from prometheus_client import CollectorRegistry, generate_latest

    merged: dict[str, Any] = {}
    for families in groups:
        for fam in families or ():
            if fam.name in merged:
                merged[fam.name].samples.extend(fam.samples)
            else:
                merged[fam.name] = fam
    registry = CollectorRegistry()
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)


class _Families:
    """A collector that hands out metric families gathered elsewhere."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families
