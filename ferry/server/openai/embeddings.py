"""``POST /v1/embeddings``: OpenAI's embeddings of the served model, its prompt's final hidden
states pooled (the last token's, or ``"pooling": "mean"``) and L2-normalised, as floats or as
base64 of little-endian float32 (what the openai SDK asks for and decodes)."""
from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import ConfigDict, StrictInt, StrictStr

from ferry.core.sampling_params import SamplingParams
from ferry.server.context import model_context
from ferry.server.errors import APIError
from ferry.server.generation import collect
from ferry.server.json_body import BoundedJSONRoute
from ferry.server.openai.completions import prompts_of
from ferry.server.protocol import TextRequest

router = APIRouter(route_class=BoundedJSONRoute)


class EmbeddingRequest(TextRequest):
    """OpenAI's embeddings request; ``pooling`` is ferry's (vLLM's pooling type), ``priority`` vLLM's."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    pooling: Literal["last", "mean"] = "last"
    priority: StrictInt = 0


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, raw: Request) -> dict[str, Any]:
    ctx = await model_context(raw, body.model)
    try:
        prompts = prompts_of(body.input)
    except APIError as e:
        raise APIError(400, e.message.replace("prompt", "input"), param="input") from None
    if body.dimensions is not None:  # the served model is no Matryoshka model: one size only
        raise APIError(400, "dimensions: this model's embeddings have one size only; leave dimensions out",
                       param="dimensions")
    sp = SamplingParams(pooling=body.pooling, max_tokens=1)  # it generates nothing: no room to reserve
    stream = await ctx.submit(ctx.sub_requests(prompts, sp, 1, body.priority))
    outs = await collect(stream, raw)
    if any(o.embedding is None for o in outs):
        raise APIError(500, "the engine returned no embedding (this executor does not pool)", "server_error")
    n = sum(len(o.prompt_token_ids) for o in outs)
    return {"object": "list", "model": ctx.model_name,
            "data": [{"object": "embedding", "index": i, "embedding": encode(o.embedding or [], body.encoding_format)}
                     for i, o in enumerate(outs)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}
