"""The HTTP API over the async engine: ``build_app`` mounts one router per protocol.

Routes: GET|HEAD /health, GET /metrics, POST /reset_prefix_cache (here); GET /v1/models[/{id}],
POST /models/load, /models/unload, POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, POST /v1/embeddings
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
from ferry.server.chat_page import chat_page_router
from ferry.server.context import ChatLimits, ServerContext
from ferry.server.dashboard import dashboard_router
from ferry.server.endpoint_metrics import EndpointMetrics
from ferry.server.errors import APIError, error_response, install_error_handlers
from ferry.server.guard import Guard, ScrubQueryKey
from ferry.server.json_body import DEFAULT_MAX_JSON_VALUES
from ferry.server.model_pool import ModelLeases, ModelPool

if TYPE_CHECKING:
    from ferry.server.replicas import ReplicaSet  # imports Ray's names only when used

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


def build_app(engine: AsyncEngine | ReplicaSet | ModelPool, model_name: str | None = None,
              api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              allowed_origins: list[str] | None = None, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, chat_limits: ChatLimits | None = None,
              max_request_json_values: int = DEFAULT_MAX_JSON_VALUES) -> FastAPI:
    """The ASGI app over the models of a ``ModelPool`` (``model_pool.py``), or over one engine
    (AsyncEngine) or data-parallel replicas (ReplicaSet, the same methods) served as ``model_name``:
    a pool of one. The loaded engines' step loops start with the app and stop with it, and so do
    the chat template's render workers (``templates.py``); ``chat_limits``: what a chat may ask;
    ``max_request_json_values``: more values in a JSON body are refused before it is parsed."""
    from ferry.server import tokenize
    from ferry.server.anthropic import messages
    from ferry.server.openai import chat, completions, embeddings, models, responses

    if isinstance(engine, ModelPool):
        pool = engine
    else:
        assert model_name is not None, "name the model the engine serves"
        pool = ModelPool.of_one(model_name, engine)
    one = next(iter(pool.entries.values())) if pool.single else None
    # The label of what no model answered (a 401, /health); each model's requests carry their own.
    label = one.name if one is not None else ""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.start()  # the chat templates get ready in the background: /health answers meanwhile
        yield
        await pool.stop()
        await ctx.close_renders()

    app = FastAPI(title="ferry", lifespan=lifespan)
    # Each model's context is this one with its engine (``ModelPool.attach``); with one model,
    # this is that model's, as a server of one model always had.
    app.state.ctx = ctx = ServerContext(one.front if one is not None else None, label, tool_call_parser,
                                        reasoning_parser, limits=chat_limits or ChatLimits())
    app.state.models = pool
    app.state.max_request_json_values = max_request_json_values  # read by BoundedJSONRoute
    pool.attach(ctx)
    app.add_middleware(ModelLeases, pool=pool)
    app.add_middleware(Guard, api_key=api_key, max_request_bytes=max_request_bytes)
    if allowed_origins:  # outermost, so a browser's preflight is answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    install_error_handlers(app)
    counted: list[EndpointMetrics] = []

    def endpoint_metrics(inner: Any, model_name: str) -> EndpointMetrics:
        counted.append(EndpointMetrics(inner, model_name))
        return counted[-1]

    app.add_middleware(endpoint_metrics, model_name=label)  # 401s and 413s count too
    app.add_middleware(ScrubQueryKey, api_key=api_key)  # outermost: no layer sees or logs a key in a query

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        error = pool.engine_error()  # with several models, one that failed fails only its own requests
        if error is not None:
            return error_response(APIError(503, f"engine stopped: {error}", "server_error"))
        if pool.draining:  # shutting down: a load balancer should send new traffic elsewhere
            return error_response(APIError(503, "the server is shutting down (draining)", "server_error",
                                           code="draining"))
        return Response(status_code=200)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        """Forget every cached prefix (vLLM's endpoint of that name): benchmarks start cold."""
        return {"num_blocks_freed": await pool.reset_prefix_cache()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        by_endpoint = counted[-1].text() if counted else b""
        return Response(await pool.prometheus() + by_endpoint, media_type=CONTENT_TYPE_LATEST)

    for module in (models, completions, chat, responses, embeddings, tokenize, messages):
        app.include_router(module.router)
    app.include_router(dashboard_router(pool, pool.dashboard_model))  # the first loaded model's
    app.include_router(chat_page_router())
    return app
