"""Chat templates rendered within bounds. A template is code (a loop, or one huge string, runs until
it is done, and a thread cannot be halted from outside), so every render runs in a worker process
(``template_worker.py``) with its memory capped; at a deadline, or when the client disconnects,
the render is cancelled (a signal the worker turns into an exception in the template), and a
worker that does not answer the cancel, being inside one long C call, is killed.

Each pool bounds how many renders run at once, and so how many workers it has; they start on
first use and live on. The server keeps two: one for its model's template, one (at a lower CPU
priority) for the templates requests bring when ``--trust-request-chat-template`` allows them,
so that neither waits for the other's workers nor takes the engine's CPU.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)

MEMORY_BYTES = 512 * 2**20  # a worker's data beyond its idle footprint: a render needing more fails
CANCEL_GRACE_SECONDS = 1.0  # a worker that has not answered a cancel by then is killed
START_SECONDS = 120.0  # a worker's start imports transformers: slow on a busy machine
POLL_SECONDS = 0.25  # how often a render in progress asks whether its client is still there

Disconnected = Callable[[], Awaitable[bool]]


class RenderFailed(Exception):
    """A render that gave no text: ``kind`` is "timeout", "disconnected", "died" (its worker
    ended), or the worker's own: "template", "value", "too_long", "memory"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


def request_frame(request: dict[str, Any]) -> bytes:
    body = json.dumps(request, default=str).encode()  # default: a special token given as an object
    return len(body).to_bytes(4, "big") + body


class Worker:
    """One worker process and its pipes; ``usable`` until it is killed, ends or says it will."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.usable = True

    @classmethod
    async def start(cls, nice: int, memory: int) -> "Worker":
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # no idle BLAS threads
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ferry.server.template_worker", str(nice), str(memory),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
            start_new_session=True)  # a terminal's Ctrl-C is the server's to handle, not the workers'
        worker = cls(proc)
        try:
            await asyncio.wait_for(worker._reply(), START_SECONDS)  # it says it is ready
        except BaseException:
            worker.kill()
            raise
        return worker

    async def _reply(self) -> tuple[dict[str, Any], bytes]:
        out = self.proc.stdout
        assert out is not None
        body = await out.readexactly(int.from_bytes(await out.readexactly(4), "big"))
        head, _, text = body.partition(b"\n")
        return json.loads(head), text

    async def render(self, frame: bytes, seconds: float, disconnected: Disconnected | None
                     ) -> tuple[dict[str, Any], bytes]:
        """The worker's reply to one request: (header, rendered text in UTF-8); RenderFailed
        when the deadline passes or the client leaves first."""
        assert self.proc.stdin is not None
        reply = asyncio.ensure_future(self._reply())
        try:
            self.proc.stdin.write(frame)
            await self.proc.stdin.drain()
            why = await self._watch(reply, seconds, disconnected)
            if why is None:
                head, text = reply.result()
                self.usable = not head.get("exit")
                return head, text
            self.proc.send_signal(signal.SIGUSR1)
            done, _ = await asyncio.wait({reply}, timeout=CANCEL_GRACE_SECONDS)
            if done:
                reply.result()  # answered (cancelled, or done just before): the worker goes on
            log.warning("a chat template render was cut short (%s)%s", why,
                        "" if done else "; its worker did not answer the cancel and was killed")
            raise RenderFailed(why, why)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self.kill()
            raise RenderFailed("died", f"its process ended ({type(e).__name__})") from None
        finally:
            if not reply.done():  # killed, or the request itself was cancelled: the worker goes
                reply.cancel()
                self.kill()

    @staticmethod
    async def _watch(reply: asyncio.Future, seconds: float, disconnected: Disconnected | None) -> str | None:
        """None once the reply is in; otherwise why the render must end now."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return "timeout"
            done, _ = await asyncio.wait({reply}, timeout=min(POLL_SECONDS, left))
            if done:
                return None
            if disconnected is not None and await disconnected():
                return "disconnected"

    def kill(self) -> None:
        self.usable = False
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass


class RenderPool:
    """Up to ``size`` renders at once, each in a worker of its own (started as needed, ``nice``
    lower in CPU priority, ``memory`` bytes of data beyond its start)."""

    def __init__(self, size: int, nice: int = 0, memory: int = MEMORY_BYTES) -> None:
        self.size, self.nice, self.memory = size, nice, memory
        self._slots = asyncio.Semaphore(size)
        self._idle: list[Worker] = []
        self._workers: set[Worker] = set()

    async def _worker(self) -> Worker:
        if self._idle:
            return self._idle.pop()
        worker = await Worker.start(self.nice, self.memory)
        self._workers.add(worker)
        return worker

    def _done_with(self, worker: Worker) -> None:
        if worker.usable and worker.proc.returncode is None:
            self._idle.append(worker)
        else:
            worker.kill()
            self._workers.discard(worker)

    async def render(self, request: dict[str, Any], seconds: float, disconnected: Disconnected | None = None,
                     small: bool = False) -> tuple[dict[str, Any], bytes]:
        """The worker's reply (header, text) to ``request`` (``template_worker.py`` says what it
        holds), within ``seconds`` of the render's start; RenderFailed when it gave none.
        ``small``: the request is a few kB, written without a hop to a thread."""
        # A long conversation's JSON is written off the event loop.
        frame = request_frame(request) if small else await asyncio.to_thread(request_frame, request)
        async with self._slots:
            try:
                worker = await self._worker()
            except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError, ValueError) as e:
                raise RenderFailed("died", f"a render worker did not start ({type(e).__name__})") from None
            try:
                return await worker.render(frame, seconds, disconnected)
            finally:
                self._done_with(worker)

    async def warm(self) -> None:
        """Start one worker ahead of the first render."""
        async with self._slots:
            if not self._idle:
                try:
                    self._done_with(await self._worker())
                except Exception as e:  # the first render will say what is wrong
                    log.warning("a chat template worker did not start: %s", e)

    async def close(self) -> None:
        for worker in list(self._workers):
            worker.kill()
        for worker in list(self._workers):
            try:
                await asyncio.wait_for(worker.proc.wait(), 5)
            except (asyncio.TimeoutError, ProcessLookupError):
                pass
        self._workers.clear()
        self._idle.clear()
