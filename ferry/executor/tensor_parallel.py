"""Tensor parallelism: one model split over N rank processes, driven by the one engine.

The scheduler runs once, in the driver (the engine's process). Each step the driver sends the
plain-data scheduler output to every rank over a pipe; every rank packs the same batch and runs
its shard of the forward pass, the ranks joining their partial results with torch.distributed
collectives (gloo on the CPU, nccl on CUDA); rank 0 samples and sends the result back. The
tokens rank 0 sampled reach the other ranks with the next step's message, so their request
state (the tokens a decode feeds in) stays the same as rank 0's.

The ranks are started with the "spawn" method, which imports the main module again in each rank:
a script that builds a tensor-parallel engine at top level needs ``if __name__ == "__main__":``
(as with vLLM); ``ferry`` commands and pytest have it.

Nothing hangs: the driver waits for each reply with a deadline, and sees a rank process die at
once (its pipe closes); a rank stuck in a collective gets torch.distributed's timeout. Either way
the engine stops with ExecutorDead, which names the rank.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import time
import weakref
from datetime import timedelta
from multiprocessing import connection
from typing import Any

from ferry.config import EngineConfig
from ferry.core.outputs import ExecutorDead, ModelRunnerOutput, SchedulerOutput
from ferry.core.sampling_params import SamplingParams
from ferry.executor.base import Executor

log = logging.getLogger(__name__)

# A rank loads its shard within this (the first load of a GGUF converts it: minutes on a slow disk).
LOAD_TIMEOUT_S = 900.0
# The driver's deadline for a step is the collectives' timeout plus this: a rank that timed out
# in a collective has time to say so before the driver gives up on it.
REPLY_GRACE_S = 30.0
OTHER_RANK_FAILED = "another tensor-parallel rank could not prepare the step"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelExecutor(Executor):
    """The driver's side: starts ``config.tensor_parallel_size`` rank processes, ships each
    step's scheduler output to them, returns rank 0's sampled tokens. Same interface as
    ModelExecutor (the engine cannot tell them apart), less the step profile (``set_profiler`` is
    the base's, which times nothing)."""

    def __init__(self, config: EngineConfig) -> None:
        import torch.multiprocessing as mp

        from ferry.executor.model_executor import ModelSetup
        from ferry.executor.structured import GrammarCompiler
        from ferry.model.tensor_parallel import ShardPlan

        setup = ModelSetup.resolve(config)
        world = config.tensor_parallel_size
        ShardPlan.make(setup.model_config, 0, world)  # a model that does not split fails here, named
        if setup.device.type == "cuda":
            import torch

            if torch.cuda.device_count() < world:
                raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs; torch sees "
                                 f"{torch.cuda.device_count()}")
        self.config = config
        self._sent_images: set[bytes] = set()  # images whose pixels the ranks hold (``without_sent_pixels``)
        self.device, self.dtype_name = setup.device, setup.dtype_name
        self.max_model_len = setup.max_model_len
        self.model_config = setup.model_config
        self.vocab_size = setup.model_config.vocab_size
        self.tokenizer = setup.tokenizer
        self.eos_token_ids = setup.eos_token_ids
        self.block_size = config.block_size
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                        max_compile_seconds=config.max_grammar_compile_seconds)
        self.timeout = config.distributed_timeout_seconds
        self._pending: dict[str, list[int]] = {}  # rank 0's tokens the other ranks have not seen
        self.dead: str | None = None

        ctx = mp.get_context("spawn")  # fork would copy the driver's threads and OpenMP state
        port = _free_port()
        self.procs, self.conns = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(config, rank, port, child), name=f"ferry-tp-rank{rank}",
                            daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        ready = self._replies(LOAD_TIMEOUT_S)
        self.num_kv_blocks = ready[0]

    def check_sampling_params(self, sp: SamplingParams) -> Any:
        """Raise ValueError (naming the field) if ``sp`` cannot be served; compiles its grammar
        and returns it (for ``hold_grammar``), or None."""
        return None if sp.structured_outputs is None else self.grammars.validate(sp.structured_outputs)

    def hold_grammar(self, request_id: str, compiled: Any) -> None:
        """Keep a queued request's compiled grammar until it ends (the cache may drop it meanwhile)."""
        self.grammars.hold(request_id, compiled)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.dead is not None:
            raise ExecutorDead(self.dead)
        # Rank 0 samples: it gets the grammars of new requests as the driver compiled them, so it
        # never compiles one on the step loop.
        grammars = {r.request_id: g for r in out.new_requests
                    if (g := self.grammars.serialized(r.request_id)) is not None}
        self.grammars.release(out.finished_req_ids)
        out = without_sent_pixels(out, self._sent_images)
        msg = pickle.dumps((out, self._pending, {}), protocol=pickle.HIGHEST_PROTOCOL)
        first = pickle.dumps((out, self._pending, grammars), protocol=pickle.HIGHEST_PROTOCOL) if grammars else msg
        self._pending = {}
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(first if rank == 0 else msg)
            except OSError as e:
                self._die(f"tensor-parallel rank {rank} is gone ({e})")
        try:
            result = self._replies(self.timeout + REPLY_GRACE_S)[0]
        except Exception:
            self._sent_images.clear()  # a rank may have dropped an encoding in progress: send pixels again
            raise
        self._pending.update(result.sampled)
        return result

    def close(self) -> None:
        """Stop the rank processes (also done when the executor is collected, and at exit)."""
        self._finalizer()

    # ------------------------------------------------------------------ replies
    def _replies(self, timeout: float) -> list[Any]:
        """One reply per rank: its value if every rank succeeded. A rank's reported error raises
        RuntimeError (the engine fails that step's request(s)); a dead, hung or broken rank raises
        ExecutorDead."""
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple[str, Any]] = {}
        waiting = {c: r for r, c in enumerate(self.conns)}
        while waiting:
            # A rank that dies closes its end of the pipe: its connection turns readable, at once.
            ready = connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                ranks = ", ".join(str(r) for r in sorted(waiting.values()))
                self._die(f"tensor-parallel rank(s) {ranks} did not answer in {timeout:.0f} s (a hung collective?)")
            for conn in ready:
                rank = waiting.pop(conn)
                try:
                    replies[rank] = conn.recv()
                except (EOFError, OSError):
                    self.procs[rank].join(timeout=1)
                    self._die(f"tensor-parallel rank {rank} died (exit code {self.procs[rank].exitcode})")
                if replies[rank][0] == "fatal":  # at once: the others may wait for it for ever
                    self._die(f"tensor-parallel rank {rank} failed: {replies[rank][1]}")
        errors = [v for _, (kind, v) in sorted(replies.items()) if kind == "error"]
        if errors:  # the rank that failed says why; the others only that one did
            raise RuntimeError(sorted(errors, key=lambda m: m == OTHER_RANK_FAILED)[0])
        return [replies[r][1] for r in range(len(self.conns))]

    def _die(self, why: str) -> None:
        self.dead = why
        log.error("%s; stopping the other ranks", why)
        self._finalizer()
        raise ExecutorDead(why)


def _stop(procs: list[Any], conns: list[Any]) -> None:
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    for conn in conns:
        conn.close()


def _rank_main(config: EngineConfig, rank: int, port: int, conn: Any) -> None:
    """One rank: join the group, load the shard, then run every step the driver sends."""
    import torch
    import torch.distributed as dist

    from ferry.executor.model_executor import ModelExecutor
    from ferry.model.tensor_parallel import TorchDistributed

    from ferry.model.device import resolve_device

    # The driver decides when a rank stops (its message, or its pipe closing): a Ctrl-C or a
    # SIGTERM to the whole process group must not kill the ranks under a server that is draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    world = config.tensor_parallel_size
    try:
        if not config.num_threads:  # the cores shared out, not every rank on all of them
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
        cuda = resolve_device(config.device).type == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=config.distributed_timeout_seconds))
        ex = ModelExecutor(config, rank, TorchDistributed)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send(("fatal", f"loading: {type(e).__name__}: {e}"))
        return
    conn.send(("ok", ex.num_kv_blocks))
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the driver is gone
        if msg is None:
            break
        out, sampled_before, grammars = msg
        if rank:  # rank 0 recorded its own tokens when it sampled them
            ex.states.append_tokens({rid: t for rid, t in sampled_before.items() if rid in ex.states.requests})
        error = None
        if not out.chunks:  # encoder work alone: no forward pass, no collective
            try:
                result = ex.encode_only(out)  # every rank keeps the image rows its forward passes read
                conn.send(("ok", result if rank == 0 else None))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}"))
            continue
        try:
            for rid, text in grammars.items():
                ex.grammars.hold_serialized(rid, text)
            batch = ex.prepare(out)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        # Every rank agrees the step can run before any enters the forward pass's collectives: a
        # failure on one rank only (memory, say) must not leave the others waiting in one.
        if not ex.model.comm.agree_min(int(error is None)):
            conn.send(("error", error or OTHER_RANK_FAILED))
            continue
        try:
            forward = ex.forward(batch)
        except Exception as e:  # inside the collectives: the ranks may be out of step, stop
            conn.send(("fatal", f"{type(e).__name__}: {e}"))
            break
        if rank:
            conn.send(("ok", None))
            continue
        try:
            conn.send(("ok", ex.sample(batch, forward)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
    if dist.is_initialized():
        dist.destroy_process_group()


def without_sent_pixels(out: SchedulerOutput, sent: set[bytes]) -> SchedulerOutput:
    """The step as the ranks need it: an image's pixels travel with the first share of its encoding
    only (each rank keeps the encoding by hash); ``sent`` is updated, and forgets freed images."""
    sent.difference_update(out.freed_encoder_hashes)
    if not out.encoder_inputs:
        return out
    inputs = []
    for rid, image, upto in out.encoder_inputs:
        if image.hash in sent:
            image = dataclasses.replace(image, data=None)
        sent.add(image.hash)
        inputs.append((rid, image, upto))
    return dataclasses.replace(out, encoder_inputs=inputs)
