"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models this server serves, loaded or not
(llama-server's router's ``status``); ``POST /models/load`` and ``POST /models/unload`` (its
endpoints of those names) load or unload one now (``model_pool.py``)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictStr

from ferry.server.errors import APIError
from ferry.server.json_body import BoundedJSONRoute
from ferry.server.model_pool import model_pool

router = APIRouter(route_class=BoundedJSONRoute)


class ModelRequest(BaseModel):
    """The body of /models/load and /models/unload: the model's id."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None


@router.get("/v1/models")
async def models(raw: Request) -> dict[str, Any]:
    pool = model_pool(raw)
    return {"object": "list", "data": [pool.card(entry) for entry in pool.entries.values()]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, raw: Request) -> dict[str, Any]:
    pool = model_pool(raw)
    entry = pool.entries.get(model_id)
    if entry is None:
        raise APIError(404, f"model {model_id!r} does not exist; this server serves {pool.names()}",
                       "not_found_error", param="model", code="model_not_found")
    return pool.card(entry)


@router.post("/models/load")
async def load(body: ModelRequest, raw: Request) -> dict[str, Any]:
    """Load the model now (it answers once loaded; a model already loaded answers at once)."""
    entry = await model_pool(raw).load(body.model)
    return {"success": True, "model": entry.name}


@router.post("/models/unload")
async def unload(body: ModelRequest, raw: Request) -> dict[str, Any]:
    """Unload the model now: a 409 while it has requests in flight, a 400 if it is not loaded."""
    pool = model_pool(raw)
    await pool.unload(body.model)
    return {"success": True, "model": pool.entry(body.model).name}
