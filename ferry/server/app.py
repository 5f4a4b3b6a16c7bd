"""The HTTP API over the async engine: ``build_app`` mounts one router per protocol.

Routes: GET|HEAD /health, GET /metrics, POST /reset_prefix_cache (here); GET /v1/models[/{id}],
POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, POST /v1/embeddings
(``openai/``); POST /v1/messages[/count_tokens] (``anthropic/``); POST /tokenize, /detokenize
(``tokenize.py``); GET /dashboard[/state] (``dashboard.py``). Every error, whatever raised it, has
OpenAI's body {"error": {"message", "type", "param", "code"}}, or Anthropic's under /v1/messages (``errors.py``).
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from ferry.engine.async_engine import AsyncEngine
from ferry.server.context import ServerContext
from ferry.server.dashboard import dashboard_router
from ferry.server.endpoint_metrics import EndpointMetrics
from ferry.server.errors import APIError, error_response, install_error_handlers
from ferry.server.guard import Guard

if TYPE_CHECKING:
    from ferry.server.replicas import ReplicaSet  # imports Ray's names only when used

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


def build_app(engine: AsyncEngine | ReplicaSet, model_name: str, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              allowed_origins: list[str] | None = None, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None) -> FastAPI:
    """The ASGI app over one engine (AsyncEngine) or data-parallel replicas (ReplicaSet, the
    same methods). The engine's step loop starts with the app and stops with it."""
    from ferry.server import tokenize
    from ferry.server.anthropic import messages
    from ferry.server.openai import chat, completions, embeddings, models, responses

    if isinstance(engine, AsyncEngine) and engine.metrics is None:
        engine.observe(model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="ferry", lifespan=lifespan)
    app.state.ctx = ServerContext(engine, model_name, tool_call_parser, reasoning_parser)
    app.add_middleware(Guard, api_key=api_key, max_request_bytes=max_request_bytes)
    if allowed_origins:  # outermost, so a browser's preflight is answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    install_error_handlers(app)
    counted: list[EndpointMetrics] = []

    def endpoint_metrics(inner: Any, model_name: str) -> EndpointMetrics:
        counted.append(EndpointMetrics(inner, model_name))
        return counted[-1]

    app.add_middleware(endpoint_metrics, model_name=model_name)  # outermost: 401s and 413s count too

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if engine.error is not None:
            return error_response(APIError(503, f"engine stopped: {engine.error}", "server_error"))
        if engine.draining:  # shutting down: a load balancer should send new traffic elsewhere
            return error_response(APIError(503, "the server is shutting down (draining)", "server_error",
                                           code="draining"))
        return Response(status_code=200)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        """Forget every cached prefix (vLLM's endpoint of that name): benchmarks start cold."""
        return {"num_blocks_freed": await engine.reset_prefix_cache()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        by_endpoint = counted[-1].text() if counted else b""
        return Response(await engine.prometheus() + by_endpoint, media_type=CONTENT_TYPE_LATEST)

    for module in (models, completions, chat, responses, embeddings, tokenize, messages):
        app.include_router(module.router)
    app.include_router(dashboard_router(engine, model_name))
    return app
