"""A bound on the JSON values in a request body, checked before the body is parsed.

Parsing builds one Python object per value while holding the interpreter lock (the event loop and
the engine's Python both wait, in any thread), and a body under the size limit can hold millions of
tiny values (``[0,0,0,...]``: 8 MB took 0.5-2 s). A body with more values than any request needs
is refused before parsing, counted at memory speed by its separators."""
from __future__ import annotations

from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.routing import APIRoute

from ferry.server.errors import APIError

# Enough for a million-token prompt as ids, or an embeddings batch of 2,048 inputs of 256 ids.
DEFAULT_MAX_JSON_VALUES = 1_000_000


def json_values_bound(body: bytes) -> int:
    """An upper bound on the values in a JSON body: one per separator or container opened, plus
    one (separators inside strings count too, so text heavy in commas is over-counted)."""
    return body.count(b",") + body.count(b"[") + body.count(b"{") + body.count(b":") + 1


class BoundedJSONRoute(APIRoute):
    """FastAPI's route, refusing (413 naming the setting) a JSON body with more values than
    ``app.state.max_request_json_values`` before FastAPI parses it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def check_then_handle(request: Request) -> Response:
            bound = request.app.state.max_request_json_values
            if "json" in request.headers.get("content-type", "json").lower():
                body = await request.body()
                # Few bodies come near: most need no count at all (a value takes at least 2 bytes).
                if len(body) > 2 * bound and json_values_bound(body) > bound:
                    raise APIError(413, f"the request body holds over {bound} JSON values "
                                        f"(--max-request-json-values)", code="request_too_large")
            return await handle(request)

        return check_then_handle
