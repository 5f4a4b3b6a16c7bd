"""The chat page: ``GET /`` (one HTML page, as llama-server serves one at its root).

The page has no build step: plain HTML with an inline style and script. It holds no data, so the
guard serves it without the API key (``guard.OPEN_PAGES``); it asks for the key when the API
answers 401, keeps it in sessionStorage and sends it as ``Authorization: Bearer`` on its calls to
``GET /v1/models`` and ``POST /v1/chat/completions`` (streamed, read as server-sent events).
"""
from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE = Path(__file__).with_name("static") / "chat.html"


def inline_hashes(html: str, tag: str) -> str:
    """The CSP source list of every inline ``<tag>`` block's SHA-256, as a browser hashes it."""
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                    for b in bodies)


def content_security_policy(html: str) -> str:
    """Only the page's own script and style run, and it talks to this server alone: markup that
    slipped into a rendered answer could neither run nor send anything elsewhere."""
    return (f"default-src 'none'; script-src {inline_hashes(html, 'script')}; "
            f"style-src {inline_hashes(html, 'style')}; connect-src 'self'; img-src data:; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def chat_page_router() -> APIRouter:
    """The page's one route, for ``app.include_router``."""
    page = PAGE.read_text(encoding="utf-8")
    headers = {"Content-Security-Policy": content_security_policy(page), "Cache-Control": "no-cache",
               "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff"}
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page, headers=headers)

    return router
