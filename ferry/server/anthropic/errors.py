"""Errors in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from ferry.server.errors import APIError

# Anthropic's error types by HTTP status (its SDK raises its exception class from the status).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
          503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(e: APIError) -> dict[str, Any]:
    # The field at fault leads the message: Anthropic's body has no field of its own for it.
    message = e.message if not e.param or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": _TYPES.get(e.status, "api_error"), "message": message}}


def anthropic_error_response(e: APIError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(e), status_code=e.status, headers=e.headers)
