"""Several models behind one `ferry serve` on 127.0.0.1 (``--models-dir``, ``--model`` repeated):
each loaded on its first request as its own engine, listed by /v1/models loaded or not, evicted
least recently used past --max-loaded-models, unloaded when idle, loaded and unloaded on request,
and labelled by model in /metrics.

The models are the embedded SmolLM2's GGUF under two names (its conversion, which ferry caches by
the file's name, is linked into a cache of the test's own under both), its converted directory, and
a .gguf file that is not one."""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from ferry.config import EngineConfig
from ferry.server.errors import APIError
from tests.test_server_hardening import logged_server

KEY = "multi-t0ken"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAMES = ["a.gguf", "b.gguf", "smol"]
BROKEN = "broken.gguf"  # not a GGUF inside: its load fails
PROMPT = "The capital of France is"
TIMEOUT = 600  # a load on a busy 2-core machine


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """A models directory (a.gguf, b.gguf: the embedded GGUF; smol: its converted directory) and a
    --cache-dir where both GGUF names find their conversion made already."""
    from ferry.model.gguf_convert import embedded_gguf_path
    from ferry.model.loader import resolve_model_dir

    gguf, converted = embedded_gguf_path(), resolve_model_dir(None)
    root = tmp_path_factory.mktemp("models")
    models_dir, cache = root / "dir", root / "cache" / "models"
    models_dir.mkdir()
    cache.mkdir(parents=True)
    for name in ("a", "b"):
        (models_dir / f"{name}.gguf").symlink_to(gguf)
        (cache / converted.name.replace(gguf.stem, name, 1)).symlink_to(converted)
    (models_dir / "smol").symlink_to(converted)
    (models_dir / BROKEN).write_bytes(b"not a gguf" * 100)
    (models_dir / "mmproj-a.gguf").symlink_to(gguf)  # a projector: not a model
    (models_dir / "notes").mkdir()  # no config.json: not a model
    return models_dir, root / "cache"


def serve(models: tuple[Path, Path], *extra: str):
    models_dir, cache = models
    return logged_server("--api-key", KEY, "--cache-dir", str(cache), "--kv-cache-memory-gb", "0.25",
                         "--max-num-seqs", "8", *extra)


@pytest.fixture(scope="module")
def multi(models):
    with serve(models, "--models-dir", str(models[0])) as proc:
        yield proc


@pytest.fixture(scope="module")
def single(models):
    """Today's server of one model, on the same GGUF file."""
    from ferry.model.gguf_convert import embedded_gguf_path

    with serve(models, "--model", str(embedded_gguf_path())) as proc:
        yield proc


def post(url: str, path: str, body: dict, timeout: float = TIMEOUT) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=timeout)


def complete(url: str, model: str | None, max_tokens: int = 8) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return post(url, "/v1/completions", body if model is None else {**body, "model": model})


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def statuses(url: str) -> dict[str, str]:
    r = httpx.get(url + "/v1/models", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"]: m["status"]["value"] for m in r.json()["data"]}


def metric(url: str, name: str, model: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model_name="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for {model} in /metrics:\n{text[-3000:]}")


def unloaded(url: str, model: str) -> None:
    """``model`` unloaded, whatever earlier tests did."""
    if statuses(url)[model] == "loaded":
        r = post(url, "/models/unload", {"model": model})
        assert r.status_code == 200, r.text
    assert statuses(url)[model] == "unloaded"


def wait_for(check, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


# ---------------------------------------------------------------- listing, naming
def test_v1_models_lists_every_model_under_the_directory_loaded_or_not(multi):
    r = httpx.get(multi.url + "/v1/models", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    cards = r.json()["data"]
    assert [c["id"] for c in cards] == sorted(NAMES + [BROKEN])  # not the projector, not the bare directory
    assert all(c["object"] == "model" and c["status"]["value"] in ("loaded", "unloaded") for c in cards), cards
    one = httpx.get(multi.url + "/v1/models/smol", headers=AUTH, timeout=30)
    assert one.status_code == 200 and one.json()["id"] == "smol", one.text


def test_an_unknown_model_is_a_404_naming_it_and_listing_the_models(multi):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
                       ("/models/load", {})):
        r = post(multi.url, path, {**body, "model": "no-such-model"})
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model", err
        assert "no-such-model" in err["message"] and all(repr(n) in err["message"] for n in NAMES), err


def test_a_request_without_model_is_a_400_naming_model_when_several_are_served(multi, single):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
                       ("/tokenize", {"prompt": "hi"}), ("/models/load", {})):
        r = post(multi.url, path, body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == "model", r.text
    assert text_of(complete(single.url, None))  # one model: it needs no name, as ever


# ---------------------------------------------------------------- loading
def test_each_model_answers_and_a_gguf_answers_as_the_server_of_that_one_file(multi, single):
    expected = text_of(complete(single.url, None, max_tokens=12))
    assert expected.strip()
    for name in NAMES:
        got = text_of(complete(multi.url, name, max_tokens=12))
        assert got.strip(), name
        if name.endswith(".gguf"):
            assert got == expected, name
    assert all(statuses(multi.url)[name] == "loaded" for name in NAMES)


def test_a_model_that_fails_to_load_fails_its_own_requests_only(multi):
    r = complete(multi.url, BROKEN)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "model_load_failed" and BROKEN in err["message"], err
    card = httpx.get(multi.url + f"/v1/models/{BROKEN}", headers=AUTH, timeout=30).json()
    assert card["status"]["value"] == "failed" and card["status"]["error"] == err["message"], card
    assert metric(multi.url, "ferry:model_load_failures_total", BROKEN) >= 1
    assert httpx.get(multi.url + "/health", timeout=30).status_code == 200
    assert text_of(complete(multi.url, "a.gguf"))


def test_concurrent_first_requests_for_a_model_wait_for_one_load(multi):
    unloaded(multi.url, "b.gguf")
    loads = metric(multi.url, "ferry:model_loads_total", "b.gguf")
    logged = multi.log().count("loading model 'b.gguf'")
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(complete(multi.url, "b.gguf"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({text_of(r) for r in results}) == 1 and len(results) == 4
    assert metric(multi.url, "ferry:model_loads_total", "b.gguf") == loads + 1
    assert multi.log().count("loading model 'b.gguf'") == logged + 1


def test_models_load_and_unload_endpoints_behind_the_api_key(multi):
    assert httpx.post(multi.url + "/models/load", json={"model": "smol"}, timeout=30).status_code == 401
    assert httpx.post(multi.url + "/models/unload", json={"model": "smol"}, timeout=30).status_code == 401
    unloaded(multi.url, "smol")
    r = post(multi.url, "/models/load", {"model": "smol"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert statuses(multi.url)["smol"] == "loaded"
    r = post(multi.url, "/models/unload", {"model": "smol"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert statuses(multi.url)["smol"] == "unloaded"
    again = post(multi.url, "/models/unload", {"model": "smol"})
    assert again.status_code == 400 and again.json()["error"]["param"] == "model", again.text
    assert text_of(complete(multi.url, "smol"))  # loaded again on its next request


def test_metrics_are_labelled_by_model_in_valid_exposition(multi):
    for name in ("a.gguf", "smol"):
        text_of(complete(multi.url, name))
    text = httpx.get(multi.url + "/metrics", timeout=30).text
    for kind in ("HELP", "TYPE"):  # one per metric name, however many engines report it
        names = re.findall(rf"^# {kind} (\S+)", text, re.M)
        assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for name in ("a.gguf", "smol"):
        assert f'ferry:generation_tokens_total{{model_name="{name}"}}' in text
        assert metric(multi.url, "ferry:model_loaded", name) == 1
        assert metric(multi.url, "ferry:http_requests_total", name) >= 1  # counted under its model
    loaded = sum(1 for status in statuses(multi.url).values() if status == "loaded")
    assert re.search(rf"^ferry:models_loaded {loaded}\.0$", text, re.M), text[-2000:]
    from prometheus_client.parser import text_string_to_metric_families

    assert list(text_string_to_metric_families(text))


# ---------------------------------------------------------------- eviction, idle unload
def test_past_max_loaded_models_a_load_evicts_the_least_recently_used_idle_model(models):
    with serve(models, "--models-dir", str(models[0]), "--max-loaded-models", "1") as srv:
        text_of(complete(srv.url, "a.gguf"))
        assert statuses(srv.url) == {"a.gguf": "loaded", "b.gguf": "unloaded", BROKEN: "unloaded", "smol": "unloaded"}
        text_of(complete(srv.url, "b.gguf"))
        assert statuses(srv.url) == {"a.gguf": "unloaded", "b.gguf": "loaded", BROKEN: "unloaded", "smol": "unloaded"}
        assert metric(srv.url, "ferry:model_evictions_total", "a.gguf") == 1
        text_of(complete(srv.url, "a.gguf"))  # loaded again, evicting b
        assert metric(srv.url, "ferry:model_loads_total", "a.gguf") == 2
        assert metric(srv.url, "ferry:model_evictions_total", "b.gguf") == 1
        assert statuses(srv.url)["a.gguf"] == "loaded"
        busy_model_is_not_evicted(srv)


def busy_model_is_not_evicted(srv) -> None:
    """While a.gguf streams, a request for b.gguf waits for it to finish instead of evicting it."""
    events: list[tuple[str, float]] = []

    def stream_a() -> None:
        body = {"model": "a.gguf", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if not events:
                        events.append(("a-first", time.monotonic()))
                    reason = chunk["choices"][0]["finish_reason"]
                    if reason:
                        events.append((f"a-{reason}", time.monotonic()))

    t = threading.Thread(target=stream_a)
    t.start()
    wait_for(lambda: bool(events))
    text_of(complete(srv.url, "b.gguf"))
    events.append(("b-done", time.monotonic()))
    t.join()
    assert [e for e, _ in events] == ["a-first", "a-length", "b-done"], events


def test_idle_models_are_unloaded_and_load_again_on_request(models):
    models_dir = models[0]
    with serve(models, "--model", str(models_dir / "a.gguf"), "--model", str(models_dir / "b.gguf"),
               "--idle-unload-seconds", "2") as srv:
        assert statuses(srv.url) == {"a.gguf": "unloaded", "b.gguf": "unloaded"}
        text_of(complete(srv.url, "a.gguf"))
        wait_for(lambda: metric(srv.url, "ferry:model_unloads_total", "a.gguf") == 1)
        assert statuses(srv.url)["a.gguf"] == "unloaded"
        assert metric(srv.url, "ferry:model_evictions_total", "a.gguf") == 0
        text_of(complete(srv.url, "a.gguf"))
        assert metric(srv.url, "ferry:model_loads_total", "a.gguf") == 2


# ---------------------------------------------------------------- the memory budget (no server: stand-in engines)
class StandIn:
    """What the pool needs of an engine, without a model."""

    tokenizer = None
    max_model_len = 64
    error = None
    draining = False

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def test_a_memory_budget_evicts_and_a_busy_pool_answers_503_after_the_load_timeout(models):
    import asyncio

    from ferry.server.context import ServerContext
    from ferry.server.model_pool import ModelEntry, ModelPool, PoolSettings, estimated_bytes

    def config(name: str) -> EngineConfig:
        return EngineConfig(model=str(models[0] / name), kv_cache_memory_gb=0.25)

    gguf_gb, smol_gb = (estimated_bytes(config(n)) / 2**30 for n in ("a.gguf", "smol"))
    assert smol_gb > gguf_gb + 0.02  # float32 weights beside Q4_1's
    budget = max(smol_gb, 2 * gguf_gb) + 0.01  # both GGUFs, or smol alone

    def pool_of(memory_gb: float) -> ModelPool:
        pool = ModelPool([ModelEntry(n, config(n)) for n in NAMES],
                         PoolSettings(max_loaded=None, memory_gb=memory_gb, load_timeout_s=3.0),
                         build=lambda cfg: StandIn())
        pool.attach(ServerContext(None, ""))
        return pool

    def loaded(pool: ModelPool) -> list[str]:
        return [e.name for e in pool.loaded()]

    async def within_budget() -> None:
        pool = pool_of(budget)
        await pool.start()
        await pool.load("a.gguf")
        await pool.load("b.gguf")
        assert loaded(pool) == ["a.gguf", "b.gguf"]
        await pool.load("smol")  # evicts both, least recently used first
        assert loaded(pool) == ["smol"]
        assert [pool.evictions.labels(n)._value.get() for n in NAMES] == [1, 1, 0]
        smol = pool.entries["smol"]
        await pool.acquire(smol)  # a request in flight on smol: no room for a.gguf within the timeout
        with pytest.raises(APIError) as busy:
            await pool.load("a.gguf")
        assert busy.value.status == 503 and busy.value.headers["Retry-After"], busy.value.message
        assert loaded(pool) == ["smol"]
        pool.release(smol)
        await pool.load("a.gguf")
        assert loaded(pool) == ["a.gguf"]
        await pool.stop()

    async def over_budget() -> None:
        pool = pool_of(gguf_gb / 2)
        await pool.start()
        with pytest.raises(APIError) as big:
            await pool.load("a.gguf")
        assert big.value.status == 500 and "--models-memory-gb" in big.value.message, big.value.message
        await pool.stop()

    asyncio.run(within_budget())
    asyncio.run(over_budget())
