"""The ASGI layer in front of the app: API-key check, request-size limit, last-resort errors.

Pure ASGI on purpose: Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``) runs the
app in a task of its own and hides the client's disconnect from it, so a non-streaming request
whose client has left would run to its end.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qsl, unquote, unquote_plus, urlencode

from starlette.exceptions import HTTPException

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("ferry.server")

# The only routes an API key leaves open: probes that a load balancer or Prometheus reads. Every
# other path, whatever its spelling (a trailing slash, percent-encoding, a route added later), needs it.
OPEN = ("/health", "/metrics")
# Pages a browser opens without the key: they hold no data and ask for the key themselves.
OPEN_PAGES = ("/",)
# Query parameter names taken for the key (matched without case): any of them is stripped from the
# query, and so is any parameter whose value is the key, so that no spelling lands in the access log.
KEY_PARAMS = ("key", "api_key", "api-key")
# Where the stripped ``key`` parameter's value waits in the scope for the guard.
QUERY_KEY = "ferry.query_key"
# The one route that also takes the key as ``?key=KEY``: a browser opening a link sends no header.
# Its data (/dashboard/state) still needs the header, which the page sends.
KEY_IN_QUERY = "/dashboard"

# Draining a refused body (a client that sends it whole before reading, e.g. urllib, httpx, the
# openai SDK, would otherwise see a reset instead of the 413): at most this much, for this long.
DRAIN_BYTES = 64 * 2**20
DRAIN_SECONDS = 5.0
# HTTP versions a request line may name; anything else is a 505.
HTTP_VERSIONS = ("1.0", "1.1", "2", "2.0", "3")

# What a browser gets at /dashboard without the key: a form that reopens it with ?key=.
_KEY_FORM = b"""<!doctype html><meta charset="utf-8"><title>ferry dashboard</title>
<form method="get" action="dashboard" style="font:16px sans-serif;margin:3em">
<p>This server needs its API key.</p><input type="password" name="key" placeholder="API key" autofocus>
<button>Open the dashboard</button></form>"""


async def send_error(send: Send, status: int, message: str, type_: str, code: str | None = None,
                     headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def send_page(send: Send, status: int, html: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/html; charset=utf-8"),
                            (b"content-length", str(len(html)).encode())]})
    await send({"type": "http.response.body", "body": html})


def strip_query_key(scope: Scope, api_key: bytes | None = None) -> str | None:
    """Take the key out of the query string of any request, in place, so neither the app nor the
    access log (uvicorn logs this same scope) ever sees it: every parameter named as in
    ``KEY_PARAMS`` in any case or percent-encoding, and any parameter that holds ``api_key``; a
    query that still holds the key in any decoding (``;`` separators, ``+`` for a space) is dropped
    whole. Returns the value of the last ``key`` parameter."""
    if QUERY_KEY in scope:  # stripped already, by an outer layer
        return scope[QUERY_KEY]
    query = scope.get("query_string", b"")
    scope[QUERY_KEY] = None
    if not query:
        return None
    raw = query.decode("latin-1")
    pairs = parse_qsl(raw, keep_blank_values=True)
    secret = api_key.decode("utf-8", "replace") if api_key else None

    def is_key(name: str, value: str) -> bool:
        return name.lower() in KEY_PARAMS or (secret is not None and (secret in name or secret in value))

    kept = [(k, v) for k, v in pairs if not is_key(k, v)]
    if len(kept) < len(pairs):
        scope["query_string"] = urlencode(kept).encode()
    left = scope["query_string"].decode("latin-1")
    if secret is not None and any(secret in form for form in (left, unquote(left), unquote_plus(left))):
        scope["query_string"] = b""
    named = [v for k, v in pairs if k.lower() == "key"]
    scope[QUERY_KEY] = named[-1] if named else None
    return scope[QUERY_KEY]


class ScrubQueryKey:
    """The outermost layer: the key out of the query string before anything answers or logs the
    request (CORS answers a browser's preflight itself, and uvicorn logs that too)."""

    def __init__(self, app: Callable, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            strip_query_key(scope, self.api_key)
        await self.app(scope, receive, send)


def needs_key(scope: Scope) -> bool:
    """Whether this request's route is guarded: all but ``OPEN`` (and ``OPEN_PAGES`` for a GET).
    The path is compared as routing sees it (percent-decoded by the server), less one trailing slash."""
    path = scope["path"]
    path = path[:-1] if len(path) > 1 and path.endswith("/") else path
    if path in OPEN:
        return False
    return not (path in OPEN_PAGES and scope["method"] in ("GET", "HEAD"))


async def drain(receive: Receive) -> None:
    """Read and drop a request's body, up to ``DRAIN_BYTES`` for ``DRAIN_SECONDS``, so that a
    client still sending it can read the answer before the connection closes."""
    async def read() -> None:
        seen = 0
        while seen <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            seen += len(message.get("body", b""))

    try:
        await asyncio.wait_for(read(), DRAIN_SECONDS)
    except asyncio.TimeoutError:
        pass


class Guard:
    """Refuses requests without the API key (401) on every route but ``OPEN`` (``/health`` and
    ``/metrics``) and the pages of ``OPEN_PAGES``, bodies over ``max_request_bytes`` (413, then the
    connection closes) and HTTP versions other than 1.x (505); answers HEAD wherever GET is.

    The key is ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``, as Anthropic's clients send
    it), or ``?key=KEY`` on ``GET /dashboard`` only (the page then sends the header on its own
    requests); without it that page is a key form."""

    def __init__(self, app: Callable, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes

    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        # Anthropic's clients (Claude Code, the anthropic SDK) send the key as x-api-key.
        if b"x-api-key" in headers:
            return hmac.compare_digest(headers[b"x-api-key"].strip(), self.api_key or b"")
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        # The scheme is case-insensitive (RFC 7235); the key is compared in constant time.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key or b"")

    def query_key_ok(self, scope: Scope, key: str | None) -> bool:
        """Whether this is ``GET /dashboard?key=KEY`` with the right key."""
        if key is None or scope["method"] != "GET" or scope["path"] != KEY_IN_QUERY:
            return False
        return hmac.compare_digest(key.encode(), self.api_key or b"")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and self.api_key and not self.authorized(dict(scope["headers"])):
            return await send({"type": "websocket.close", "code": 1008})  # a policy violation: no key
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key = strip_query_key(scope, self.api_key)
        if scope.get("http_version", "1.1") not in HTTP_VERSIONS:
            return await send_error(send, 505, f"HTTP version {scope['http_version']} is not supported "
                                    f"(HTTP/1.0 and HTTP/1.1 are)", "invalid_request_error",
                                    headers={"Connection": "close"})
        headers = dict(scope["headers"])
        if (self.api_key and needs_key(scope) and not self.query_key_ok(scope, key)
                and not self.authorized(headers)):
            if scope["method"] == "GET" and scope["path"] == KEY_IN_QUERY:
                return await send_page(send, 401, _KEY_FORM)
            return await send_error(send, 401, "invalid or missing API key (send Authorization: Bearer KEY)",
                                    "invalid_request_error", "invalid_api_key",
                                    {"WWW-Authenticate": "Bearer"})
        limit = self.max_request_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            if headers.get(b"expect", b"").lower() != b"100-continue":
                await drain(receive)  # a client that asked first has sent nothing: nothing to drain
            return await send_error(send, 413, f"request body of {int(length)} bytes is over the limit of "
                                    f"{limit} bytes (--max-request-bytes)", "invalid_request_error",
                                    "request_too_large", {"Connection": "close"})
        if scope["method"] == "HEAD":
            # HEAD wherever GET is: the app answers a GET, and uvicorn (reading its own scope,
            # still HEAD) sends the headers without the body.
            scope = {**scope, "method": "GET"}
        seen = 0

        async def counted() -> Message:  # a body without Content-Length is counted as it comes
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, f"request body is over the limit of {limit} bytes "
                                             f"(--max-request-bytes)")
            return message

        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except Exception as e:
            # Answered here, not re-raised: Starlette's own last-resort handler re-raises, and
            # uvicorn then drops the connection under a client that may reuse it.
            log.exception("unexpected error on %s", scope["path"])
            if not started:
                await send_error(send, 500, f"internal error: {type(e).__name__}", "server_error")
