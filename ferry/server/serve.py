"""``ferry serve``: load the model, start the step loop, serve HTTP until SIGTERM/SIGINT."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path

import uvicorn

from ferry.config import EngineConfig

DEFAULT_NAME = "SmolLM2-135M-Instruct"
log = logging.getLogger("ferry.serve")


def add_server_args(p: argparse.ArgumentParser) -> None:
    from ferry.server.app import DEFAULT_MAX_REQUEST_BYTES
    from ferry.server.reasoning import REASONING_PARSERS
    from ferry.server.tools.parsers import PARSERS

    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", help="the model id clients send (default: the model's directory name)")
    g.add_argument("--api-key", default=os.environ.get("FERRY_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes and the API docs (or set FERRY_API_KEY)")
    g.add_argument("--max-waiting-requests", type=int, default=512,
                   help="past this many waiting requests, new ones get 503 with Retry-After")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies are refused with 413 (default: 8 MiB)")
    g.add_argument("--allowed-origins", default=None,
                   help="comma-separated origins allowed by CORS, or '*' (default: CORS off)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM, seconds to let requests in flight finish before aborting them")
    g.add_argument("--log-level", default="info")
    g.add_argument("--tool-call-parser", default=None,
                   choices=sorted(PARSERS),
                   help="the format the model writes tool calls in (default: read from the chat template)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split the model's <think>...</think> text into reasoning_content (default: off)")
    from ferry.server.router import add_router_args

    add_router_args(p)
    p.add_argument("--ray-address", default=None,
                   help="with --data-parallel-size > 1: the Ray cluster to join ('auto', or host:port); "
                        "default: start a local one")


def cmd_serve(args: argparse.Namespace, config: EngineConfig) -> int:
    from ferry.engine.async_engine import AsyncEngine
    from ferry.engine.llm_engine import LLMEngine
    from ferry.server.app import build_app

    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    name = args.served_model_name or (Path(config.model).name if config.model else DEFAULT_NAME)
    if args.data_parallel_size > 1:
        from ferry.server.replicas import ReplicaSet
        from ferry.server.router import RouterConfig

        front = ReplicaSet(config, args.data_parallel_size, RouterConfig(policy=args.router_policy), name,
                           args.max_waiting_requests, args.ray_address)
        where = (f"{args.data_parallel_size} replicas on Ray, {front.infos[0]['num_kv_blocks']} KV blocks each, "
                 f"router {args.router_policy}")
    elif args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    else:
        front = AsyncEngine(lambda: LLMEngine.from_config(config), args.max_waiting_requests)
        where = f"{front.engine.num_kv_blocks} KV blocks"
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()] if args.allowed_origins else None
    app = build_app(front, name, args.api_key, args.max_request_bytes, origins, args.tool_call_parser,
                    args.reasoning_parser)
    print(f"ferry: serving {name!r} on http://{args.host}:{args.port} "
          f"({where}, max_model_len {front.max_model_len})", flush=True)
    # uvicorn re-raises the signal that stopped it to the handler that was there before it; a no-op
    # one makes the orderly shutdown exit 0, as a supervisor expects.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5),
                            front, args.shutdown_timeout)
    server.run()
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn's server with ferry's shutdown: on the first SIGTERM/SIGINT, refuse new requests
    (503), let those in flight finish for ``shutdown_timeout`` seconds, then abort the rest, whose
    streams end with an error event and [DONE] and whose plain requests get a 503; only then
    does uvicorn close. A second signal stops at once."""

    def __init__(self, config, engine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if self.draining:
            return super().handle_exit(sig, frame)
        self.draining = True
        self.engine.draining = True
        threading.Thread(target=self._drain, name="ferry-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.engine.num_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        aborted = self.engine.abort_all()
        if aborted:
            log.warning("shutdown: %d request(s) still running after %.0f s were aborted", aborted,
                        self.shutdown_timeout)
        else:
            log.info("shutdown: every request in flight finished")
        time.sleep(0.2)  # let the aborted streams send their last events
        self.should_exit = True
