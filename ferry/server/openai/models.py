"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model this server serves."""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from ferry.server.context import ServerContext, context
from ferry.server.errors import APIError

router = APIRouter()


def model_card(ctx: ServerContext) -> dict[str, Any]:
    return {"id": ctx.model_name, "object": "model", "created": int(time.time()), "owned_by": "ferry",
            "max_model_len": ctx.max_model_len}


@router.get("/v1/models")
async def models(raw: Request) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(context(raw))]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, raw: Request) -> dict[str, Any]:
    ctx = context(raw)
    if model_id != ctx.model_name:
        raise APIError(404, f"model {model_id!r} does not exist; this server serves {ctx.model_name!r}",
                       "not_found_error", param="model", code="model_not_found")
    return model_card(ctx)
