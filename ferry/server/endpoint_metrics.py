"""Requests counted by endpoint and status (``ferry:http_requests_total``), in the front process: the
same with one engine or data-parallel replicas. A pure ASGI wrapper, so streams pass untouched."""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest

# The endpoints counted by name; any other path is "other" (a scan of random paths cannot grow the labels).
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/messages",
             "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/v1/models", "/health", "/metrics",
             "/models/load", "/models/unload")


class EndpointMetrics:
    """ASGI middleware: one count per HTTP request, labelled by endpoint and response status."""

    def __init__(self, app: Any, model_name: str) -> None:
        self.app = app
        self.registry = CollectorRegistry()
        self.requests = Counter("ferry:http_requests", "HTTP requests by endpoint and status.",
                                ["model_name", "endpoint", "status"], registry=self.registry)
        self.model_name = model_name

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") \
            else "/v1/responses" if path.startswith("/v1/responses/") else "other"
        status = [500]

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            # The model the request picked (a server of several models), else the server's.
            model = scope.get("ferry.model", self.model_name)
            self.requests.labels(model, endpoint, str(status[0])).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
