"""``ferry serve``: load the model, start the step loop, serve HTTP until SIGTERM/SIGINT."""
from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path

from ferry.config import EngineConfig

DEFAULT_NAME = "SmolLM2-135M-Instruct"


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", help="the model id clients send (default: the model's directory name)")
    g.add_argument("--api-key", default=os.environ.get("FERRY_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (or set FERRY_API_KEY)")
    g.add_argument("--max-waiting-requests", type=int, default=512,
                   help="past this many waiting requests, new ones get 503 with Retry-After")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM, seconds to let requests in flight finish before aborting them")
    g.add_argument("--log-level", default="info")


def cmd_serve(args: argparse.Namespace, config: EngineConfig) -> int:
    import uvicorn

    from ferry.engine.async_engine import AsyncEngine
    from ferry.engine.llm_engine import LLMEngine
    from ferry.server.app import build_app

    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    async_engine = AsyncEngine(lambda: LLMEngine.from_config(config), args.max_waiting_requests)
    engine = async_engine.engine
    name = args.served_model_name or (Path(config.model).name if config.model else DEFAULT_NAME)
    app = build_app(async_engine, name, args.api_key)
    print(f"ferry: serving {name!r} on http://{args.host}:{args.port} "
          f"({engine.num_kv_blocks} KV blocks, max_model_len {config.max_model_len})", flush=True)
    # uvicorn drains in-flight requests on SIGTERM, then re-raises the signal to the handler that was
    # there before it; a no-op one makes that orderly shutdown exit 0, as a supervisor expects.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0
