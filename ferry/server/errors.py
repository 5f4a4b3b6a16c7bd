"""The server's errors and the handlers that give every error, whatever raised it, OpenAI's body:
{"error": {"message", "type", "param", "code"}} (the Anthropic routes reshape it, ``anthropic/``)."""
from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ferry.server.protocol import UnsupportedField


class APIError(Exception):
    """An error a handler answers with: HTTP status, message, and OpenAI's type, param and code."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = \
            status, message, type_, param, code, headers


def error_body(e: APIError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


_FIELD = re.compile(r"^(?:prompt \(|prompt |)([a-z_]+)")
# pydantic names the union member or type it tried ("list[int]", "constrained-float", "function-after[...]");
# users want the path (a field named "function", as a tool call's, stays)
_TYPE_IN_LOC = re.compile(r"^((str|int|float|bool|list|dict|constrained)\b|function-)")


def bad_value(e: ValueError) -> APIError:
    """A ValueError from SamplingParams or the engine: its message starts with the field it is about."""
    if isinstance(e, UnsupportedField):
        return APIError(400, str(e), param=e.field, code="unsupported_field")
    msg = str(e)
    m = _FIELD.match(msg)
    param = "prompt" if msg.startswith("prompt") else (m.group(1) if m else None)
    return APIError(400, msg, param=param)


def validation_error(e: RequestValidationError) -> APIError:
    """A body pydantic refused, as a 400 naming the first field at fault."""
    errs = e.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', '')}".strip())
    parts, param = [], None
    for err in errs[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        loc = [x for x in loc if not _TYPE_IN_LOC.match(x)]
        field = ".".join(loc) or "body"
        # A whole-body check names its field at the start of its message.
        m = re.match(r"Value error, ([a-z_]+)", str(err.get("msg"))) if not loc else None
        param = param or (loc[0] if loc else m.group(1) if m else None)
        parts.append(f"{field}: {err.get('msg')}")
    return APIError(400, "; ".join(parts), param=param)


def http_error(request: Request, e: StarletteHTTPException) -> APIError:
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on "
               f"{request.url.path}"}.get(e.status_code, str(e.detail))
    return APIError(e.status_code, message, "not_found_error" if e.status_code == 404 else "invalid_request_error",
                    headers=getattr(e, "headers", None))


def install_error_handlers(app: FastAPI) -> None:
    """Every error in the protocol's shape: Anthropic's under /v1/messages, OpenAI's elsewhere."""

    def respond(request: Request, e: APIError) -> JSONResponse:
        if request.url.path.startswith("/v1/messages"):
            from ferry.server.anthropic.errors import anthropic_error_response

            return anthropic_error_response(e)
        return error_response(e)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return respond(request, e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return respond(request, http_error(request, e))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return respond(request, validation_error(e))
