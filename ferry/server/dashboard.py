"""The live scheduler dashboard: ``GET /dashboard`` (one HTML page) and ``GET /dashboard/state``.

The page has no build step: plain HTML with a small inline script that polls the state every
second and draws on <canvas>. Both routes sit behind the API key (``guard.py``); the page alone
also takes it as ``?key=`` and sends it as a Bearer header on its own requests.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Protocol

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE = Path(__file__).with_name("static") / "dashboard.html"


class LiveSource(Protocol):
    """An engine front that reports one live-state dict per replica (``AsyncEngine``, or the
    data-parallel front)."""

    async def live_state(self) -> list[dict[str, Any]]: ...


def dashboard_router(engine: LiveSource, model_name: str | Callable[[], str]) -> APIRouter:
    """The two routes, for ``app.include_router``; ``model_name``, or a function that gives it
    (a server of several models shows the first one loaded)."""
    page = PAGE.read_text(encoding="utf-8")
    router = APIRouter()

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        # no-referrer: the page's address may hold ?key=, which must not travel in a Referer.
        return HTMLResponse(page, headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})

    @router.get("/dashboard/state")
    async def state() -> dict[str, Any]:
        """Each replica's recent steps, current load and windowed latencies (README, "Live dashboard")."""
        name = model_name() if callable(model_name) else model_name
        return {"model": name, "time": round(time.time(), 3), "replicas": await engine.live_state()}

    return router
