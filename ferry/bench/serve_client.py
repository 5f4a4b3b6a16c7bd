"""``ferry bench serve``: a load client for any OpenAI-compatible server.

Streams /v1/completions requests (token-id prompts, ignore_eos) on a Poisson
schedule, times every chunk on the client, and reports the same metrics and JSON
fields as ``ferry bench online``. Each streamed chunk counts as one token, as
serving benchmarks count them; the completion token count comes from the usage.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from ferry.bench.workload import WorkloadRequest
from ferry.engine.metrics import RunMetrics, summarize
from ferry.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


async def _one(client: Any, url: str, model: str | None, req: WorkloadRequest, start: float,
               headers: dict[str, str], sem: asyncio.Semaphore | None) -> RequestOutput:
    await asyncio.sleep(max(0.0, start + req.arrival_time - time.perf_counter()))
    body = {"prompt": req.prompt_token_ids, "max_tokens": req.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if sem is not None:
        await sem.acquire()
    arrival = time.perf_counter()
    times: list[float] = []
    n_tokens, cached, finish, text = 0, 0, "error", ""
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                finish = "error"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        text = data["error"].get("message", "")
                        break
                    if data.get("usage"):
                        n_tokens = data["usage"]["completion_tokens"]
                        cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    for ch in data.get("choices", []):
                        if ch.get("text"):
                            times.append(time.perf_counter())
                        if ch.get("finish_reason"):
                            finish = ch["finish_reason"]
    except Exception as e:  # a refused or broken connection fails this request only
        text = f"{type(e).__name__}: {e}"
        finish = "error"
    finally:
        if sem is not None:
            sem.release()
    end = time.perf_counter()
    return RequestOutput(
        request_id="", prompt=None, prompt_token_ids=req.prompt_token_ids,
        outputs=[CompletionOutput(0, text, [0] * (n_tokens or len(times)), finish_reason=finish)], finished=True,
        metrics=RequestMetrics(arrival, None, times[0] if times else None, end, times, 0, num_cached_tokens=cached))


async def run_against_server(base_url: str, requests: list[WorkloadRequest], model: str | None = None,
                             api_key: str | None = None, max_concurrency: int | None = None,
                             progress: bool = True, reset_prefix_cache: bool = False) -> RunMetrics:
    """Send every request at its arrival_time; return the metrics measured on the client.
    ``reset_prefix_cache``: first ask the server to forget its cached prefixes (a cold start)."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if reset_prefix_cache:
        async with httpx.AsyncClient() as c:
            (await c.post(base_url.rstrip("/") + "/reset_prefix_cache", headers=headers)).raise_for_status()
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or 1000, max_keepalive_connections=100)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req", dynamic_ncols=True)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter()

        async def tracked(r: WorkloadRequest) -> RequestOutput:
            out = await _one(client, url, model, r, start, headers, sem)
            if bar is not None:
                bar.update(1)
            return out

        outs = await asyncio.gather(*(tracked(r) for r in requests))
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return summarize(list(outs), duration)
