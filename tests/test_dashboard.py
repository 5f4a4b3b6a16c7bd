"""The live dashboard: LiveState on its own, /dashboard/state's JSON and key, and the page in a real
headless Chromium (Debian's, installed by `make setup`) against a running `ferry serve` under load.

FERRY_DASHBOARD_SCREENSHOT=docs/dashboard.png saves a screenshot of the page under load.
"""
from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from ferry.core.stats import SchedulerState
from ferry.engine.live_state import LiveState, percentile
from ferry.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ferry.engine.step_stats import StepStats
from tests.test_server import MODEL, server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# Without the background-networking flags a closed network makes Chromium slow to start.
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,1000")
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Each wave of 4 must outlast a few of the page's one-second polls however fast the engine decodes
# (48 tokens a request once did; at ~5 ms a step they are gone between two polls).
NUM_REQUESTS, MAX_TOKENS = 8, 320


# ---------------------------------------------------------------- LiveState, in process
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeScheduler:
    """The scheduler's load, as ``state()`` reports it: 100 KV blocks, no preemptions."""

    def __init__(self) -> None:
        self.num_running = self.num_waiting = self.num_kv_blocks_used = 0

    def state(self) -> SchedulerState:
        return SchedulerState(self.num_running, self.num_waiting, self.num_kv_blocks_used, 100, 0)


def fake_engine() -> SimpleNamespace:
    """What LiveState reads of an engine: its budget, the last step's record, the scheduler's state."""
    return SimpleNamespace(config=SimpleNamespace(max_num_batched_tokens=64), last_step=None,
                           scheduler=FakeScheduler())


def finished(ttft: float, gaps: list[float], arrival: float = 0.0) -> RequestOutput:
    times = [arrival + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    m = RequestMetrics(arrival_time=arrival, first_scheduled_time=arrival, first_token_time=times[0],
                       finished_time=times[-1], token_times=times, num_preemptions=0)
    return RequestOutput("r", None, [1], [CompletionOutput(0, "", [0] * len(times), "length")], finished=True,
                         metrics=m, num_new_tokens=1)


def step(engine: SimpleNamespace, prefill: int, decode: int, queried: int = 0, hits: int = 0) -> None:
    engine.last_step = StepStats(start=0, duration=0.01, num_prefill_tokens=prefill, num_decode_tokens=decode,
                                 num_padding_tokens=0, num_requests=2, num_kv_blocks_used=3, num_preempted=0,
                                 num_prefix_queried_tokens=queried, num_prefix_hit_tokens=hits)


def test_live_state_keeps_recent_steps_and_windowed_latencies():
    clock, engine = Clock(), fake_engine()
    live = LiveState(window_s=10, steps_kept=5, clock=clock)
    for i in range(7):
        step(engine, prefill=10 * i, decode=2, queried=10, hits=5 if i % 2 else 0)
        engine.scheduler.num_kv_blocks_used, engine.scheduler.num_running = i, 2
        live.on_step(engine, [])
        clock.now += 1
    engine.last_step = None
    live.on_step(engine, [])  # a step that scheduled nothing adds no step
    s = live.snapshot(engine)
    assert s["num_steps"] == 7 and [x["prefill"] for x in s["steps"]] == [20, 30, 40, 50, 60]
    assert s["steps"][-1]["kv_used"] == 6 and s["steps"][-1]["budget"] == 64
    assert s["now"] == {"running": 2, "waiting": 0, "preemptions": 0, "kv_blocks_used": 6, "kv_blocks_total": 100,
                        "kv_usage": 0.06, "t": live.epoch(clock.now)}
    # Between steps (an abort freed blocks): without the engine, the counts the last step left.
    engine.scheduler.num_kv_blocks_used = 0
    assert live.snapshot()["now"]["kv_blocks_used"] == 6 and live.snapshot(engine)["now"]["kv_blocks_used"] == 0
    assert (s["window"]["prefix_cache_queries"], s["window"]["prefix_cache_hits"]) == (70, 15)
    assert s["window"]["prefix_cache_hit_rate"] == pytest.approx(15 / 70)
    # Two finished requests: TTFT 0.1 and 0.3; TPOT (last - first) / (tokens - 1) = 0.02 and 0.05.
    live.on_step(engine, [finished(0.1, [0.02] * 4), finished(0.3, [0.05, 0.05])])
    w = live.snapshot(engine)["window"]
    assert w["finished"] == 2 and w["output_tokens"] == 2
    assert w["ttft"]["p50"] == pytest.approx(0.2) and w["ttft"]["p99"] == pytest.approx(0.298)
    assert w["tpot"]["p50"] == pytest.approx(0.035) and w["tpot"]["p90"] == pytest.approx(0.047)
    assert w["output_tokens_per_s"] == pytest.approx(2 / 7)  # the server is 7 s old: not 2 / 10
    clock.now += 11  # the window moves past them
    w = live.snapshot(engine)["window"]
    assert w["finished"] == 0 and w["output_tokens_per_s"] == 0 and w["ttft"]["p50"] is None
    assert w["prefix_cache_hit_rate"] is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([], 90) is None


# ---------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def srv():
    with server("--api-key", KEY, "--max-num-seqs", "4") as proc:
        yield proc.url


def state(url: str) -> dict:
    # Answered between two steps: a cold prefill step here can take several seconds.
    r = httpx.get(url + "/dashboard/state", headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle_state(url: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while True:
        now = state(url)["replicas"][0]["now"]
        if now["running"] == now["waiting"] == now["kv_blocks_used"] == 0:
            return
        assert time.time() < deadline, now
        time.sleep(0.1)


def test_state_json_shape(srv):
    client = openai.OpenAI(base_url=srv + "/v1", api_key=KEY)
    client.completions.create(model=MODEL, prompt="The dashboard shows", max_tokens=4, temperature=0)
    d = state(srv)
    assert set(d) == {"model", "time", "replicas"} and d["model"] == MODEL
    assert abs(d["time"] - time.time()) < 60 and len(d["replicas"]) == 1
    r = d["replicas"][0]
    assert set(r) == {"replica", "time", "budget", "num_steps", "num_output_tokens", "num_finished", "steps",
                      "now", "window"}
    assert r["replica"] == "0" and r["budget"] == 512
    assert r["num_output_tokens"] >= 4 and r["num_finished"] >= 1 and r["num_steps"] >= 4
    assert 1 <= len(r["steps"]) <= 240
    for s in r["steps"]:
        assert set(s) == {"t", "duration", "prefill", "decode", "padding", "budget", "requests", "preempted",
                          "running", "waiting", "kv_used"}
        assert s["budget"] == 512 and s["prefill"] + s["decode"] + s["padding"] <= 512
        assert abs(s["t"] - d["time"]) < 600
    assert r["steps"][-1]["t"] <= r["time"] and [s["t"] for s in r["steps"]] == sorted(s["t"] for s in r["steps"])
    assert set(r["now"]) == {"running", "waiting", "preemptions", "kv_blocks_used", "kv_blocks_total", "kv_usage",
                             "t"}
    assert r["now"]["kv_blocks_total"] > 0 and r["steps"][-1]["t"] <= r["now"]["t"] <= r["time"]
    w = r["window"]
    assert set(w) == {"seconds", "span", "finished", "output_tokens", "output_tokens_per_s", "prefix_cache_queries",
                      "prefix_cache_hits", "prefix_cache_hit_rate", "ttft", "tpot"}
    assert 0 <= w["prefix_cache_hits"] <= w["prefix_cache_queries"]
    assert w["seconds"] == 60 and 0 < w["span"] <= 60 and w["output_tokens_per_s"] > 0
    for name in ("ttft", "tpot"):
        assert set(w[name]) == {"p50", "p90", "p99"}
        assert 0 < w[name]["p50"] <= w[name]["p90"] <= w[name]["p99"]


def test_dashboard_and_state_need_the_key(srv):
    page = httpx.get(srv + "/dashboard")
    assert page.status_code == 401 and "text/html" in page.headers["content-type"]  # the key form
    assert 'name="key"' in page.text and "<canvas" not in page.text
    assert httpx.get(srv + "/dashboard", params={"key": "wrong"}).status_code == 401
    assert httpx.get(srv + "/dashboard", headers={"Authorization": "Bearer wrong"}).status_code == 401
    for ok in (httpx.get(srv + "/dashboard", params={"key": KEY}), httpx.get(srv + "/dashboard", headers=AUTH)):
        assert ok.status_code == 200 and "<canvas" in ok.text
    r = httpx.get(srv + "/dashboard/state")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # ?key= is for the page alone: the data needs the header.
    assert httpx.get(srv + "/dashboard/state", params={"key": KEY}).status_code == 401
    assert httpx.post(srv + "/dashboard", params={"key": KEY}).status_code == 401
    assert httpx.get(srv + "/dashboard/state", headers=AUTH).status_code == 200


def test_the_key_in_the_query_is_removed_once_checked():
    """uvicorn's access log prints the scope the app gets: the key must not be in it."""
    import asyncio

    from ferry.server.guard import Guard

    seen: list[bytes] = []

    async def app(scope, receive, send) -> None:
        seen.append(scope["query_string"])

    async def call(query: bytes, path: str = "/dashboard") -> None:
        async def send(message) -> None:
            pass

        scope = {"type": "http", "method": "GET", "path": path, "query_string": query, "headers": []}
        await Guard(app, KEY, 1000)(scope, None, send)  # type: ignore[arg-type]

    asyncio.run(call(b"theme=dark&key=" + KEY.encode()))
    asyncio.run(call(b"key=wrong"))  # refused: the app is not called
    asyncio.run(call(b"key=" + KEY.encode(), "/dashboard/state"))  # not the page: refused
    assert seen == [b"theme=dark"]


# ---------------------------------------------------------------- the page in Chromium
@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    # CI installs Chromium (`make setup`): a missing one is a failure, never a skip.
    assert os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER), \
        "no /usr/bin/chromium or /usr/bin/chromedriver: `make setup` installs them (apt-get install chromium chromium-driver)"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    # An explicit driver path: selenium never tries to download one.
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


# Every number of the totals row, and the replica's own, as the page shows them.
READ_DOM = """
const pick = (els, key) => Object.fromEntries([...els].map((e) => [key(e), e.textContent]));
return {total: pick(document.querySelectorAll('[id^="total-"]'), (e) => e.id.slice(6)),
        replica: pick(document.querySelectorAll('[data-replica="0"] .cards [data-field]'),
                      (e) => e.getAttribute('data-field')),
        polls: document.getElementById('polls').textContent, model: document.getElementById('model').textContent,
        read_at: document.querySelector('[data-replica="0"]')?.getAttribute('data-time')};
"""


def read_dom(driver) -> dict:
    dom = driver.execute_script(READ_DOM)

    def number(text: str) -> float | None:
        return None if text in ("—", "") else float(text)

    return {"polls": int(dom["polls"]), "model": dom["model"], "read_at": number(dom["read_at"] or ""),
            **{k: number(v) for k, v in dom["total"].items()},
            "replica": {k: number(v) for k, v in dom["replica"].items()}}


def wait_until(read, check, timeout: float, what: str, every: float = 0.2):
    """``read()`` again every ``every`` seconds until ``check`` passes it; fails after ``timeout``."""
    deadline = time.time() + timeout
    while True:
        dom = read()
        if check(dom):
            return dom
        assert time.time() < deadline, f"the page never showed {what}: {dom}"
        time.sleep(every)


def wait_for(driver, check, timeout: float, what: str) -> dict:
    return wait_until(lambda: read_dom(driver), check, timeout, what)


def send_load(url: str, errors: list[BaseException]) -> list[threading.Thread]:
    """NUM_REQUESTS streaming completions at once (4 run, the rest wait), of different prompt lengths."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)

    def one(i: int) -> None:
        try:
            for _ in client.completions.create(model=MODEL, prompt=[200 + i] * (40 + 45 * i), max_tokens=MAX_TOKENS,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True}):
                pass
        except BaseException as e:  # reported by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_REQUESTS)]
    for t in threads:
        t.start()
    return threads


def test_page_follows_the_scheduler_under_load(srv, browser):
    client = openai.OpenAI(base_url=srv + "/v1", api_key=KEY)
    client.completions.create(model=MODEL, prompt=[300] * 400, max_tokens=2)  # warm: the first steps are slow
    browser.get(srv + f"/dashboard?key={KEY}")
    first = wait_for(browser, lambda d: d["polls"] >= 1 and d["model"] == MODEL, 30, "a first poll")
    wait_idle_state(srv)
    base = wait_for(browser, lambda d: d["polls"] > first["polls"], 10, "a second poll")
    assert base["running"] == 0 and base["kv-total"] == state(srv)["replicas"][0]["now"]["kv_blocks_total"]

    errors: list[BaseException] = []
    threads = send_load(srv, errors)
    samples, shot = [], os.environ.get("FERRY_DASHBOARD_SCREENSHOT")
    started = time.time()
    while any(t.is_alive() for t in threads):
        dom = read_dom(browser)
        samples.append((dom, state(srv)["replicas"][0]))
        # For the docs: the second wave running, the first one's latencies in.
        if shot and dom["running"] == 4 and dom["finished-total"] - base["finished-total"] >= 4 \
                and dom["steps"] - base["steps"] >= 60:
            browser.save_screenshot(shot)
            shot = None
        assert time.time() - started < 420, "the load took too long"
        time.sleep(0.25)
    for t in threads:
        t.join()
    assert not errors, errors
    assert shot is None, "no moment with 4 running to take the screenshot at"

    # The page moved with the requests.
    assert max(d["running"] for d, _ in samples) == 4  # --max-num-seqs
    assert max(d["waiting"] for d, _ in samples) > 0
    assert max(d["kv-used"] for d, _ in samples) > 0 and max(d["throughput"] for d, _ in samples) > 0
    # The KV blocks shown are exactly what the engine held when the page's counts were read
    # (data-time): what the last step before then left, in the state's step history.
    checked = 0
    for d, r in samples:
        assert d["kv-total"] == r["now"]["kv_blocks_total"]
        assert d["kv-pct"] == pytest.approx(100 * d["kv-used"] / d["kv-total"], abs=0.06)
        before = [x for x in r["steps"] if x["t"] <= d["read_at"]]
        if before:  # else it was read before the oldest step the state keeps
            assert d["kv-used"] == before[-1]["kv_used"], (d, before[-3:])
            checked += 1
    assert checked >= 5, (checked, len(samples))

    # Once idle, every count settles on what the requests did.
    tokens = NUM_REQUESTS * MAX_TOKENS
    end = wait_for(browser, lambda d: d["output-tokens"] - base["output-tokens"] == tokens and d["running"] == 0
                   and d["kv-used"] == 0, 30, f"{tokens} more output tokens and an idle engine")
    assert end["steps"] - base["steps"] >= 2 * MAX_TOKENS  # two waves of 4 at one token per step
    assert end["finished-total"] - base["finished-total"] == NUM_REQUESTS and end["waiting"] == 0
    assert 1 <= end["finished"] <= end["finished-total"]  # those of the last 60 s
    for name in ("ttft", "tpot"):
        p50, p90, p99 = (end[f"{name}-p{q}"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99
    truth = state(srv)["replicas"][0]
    assert end["steps"] <= truth["num_steps"] and end["output-tokens"] == truth["num_output_tokens"]
    assert end["preemptions"] == truth["now"]["preemptions"]
    # One replica: its own numbers are the totals.
    assert {k: end[k] for k in end["replica"]} == end["replica"]


# ---------------------------------------------------------------- several replicas, no model
class FakeReplicas:
    """What a data-parallel front reports: two replicas with counts, a third that did not answer."""

    def __init__(self) -> None:
        self.polls = 0

    async def live_state(self) -> list[dict]:
        self.polls += 1
        out = []
        for name, running, ttft in (("0", 3, 0.1), ("1", 5, 0.4)):
            clock, engine = Clock(), fake_engine()
            live = LiveState(clock=clock)
            for i in range(30 + self.polls):  # a step more each poll
                step(engine, prefill=40 if i % 5 == 0 else 0, decode=running)
                engine.scheduler.num_running, engine.scheduler.num_kv_blocks_used = running, 10 * running
                live.on_step(engine, [finished(ttft, [0.02] * 3)] if i % 10 == 0 else [])
                clock.now += 0.05
            out.append({"replica": name, **live.snapshot(engine), "alive": True, "routed": 7})
        return out + [{"replica": "2", "alive": False, "routed": 2, "in_flight": 0}]


@pytest.fixture(scope="module")
def fake_srv():
    from fastapi import FastAPI

    from ferry.server.dashboard import dashboard_router
    from tests.test_server import serve_in_thread

    app = FastAPI()
    app.include_router(dashboard_router(FakeReplicas(), "fake-model"))
    with serve_in_thread(app) as url:
        yield url


def test_page_draws_every_replica_and_totals_them(fake_srv, browser):
    browser.get(fake_srv + "/dashboard")
    dom = wait_for(browser, lambda d: d["polls"] >= 2 and d["model"] == "fake-model", 30, "two polls")
    names = browser.execute_script(
        "return [...document.querySelectorAll('[data-replica]')].map((e) => e.getAttribute('data-replica'))")
    assert names == ["0", "1", "2"]

    def field(replica: str, name: str) -> str:
        return browser.execute_script(
            f"return document.querySelector('[data-replica=\"{replica}\"] [data-field=\"{name}\"]').textContent")

    assert field("1", "running") == "5" and field("0", "running") == "3"
    assert "no answer" in field("2", "extra") and "dead" in field("2", "extra")
    assert field("2", "running") == ""  # nothing to show for it
    # Totals add the replicas that answered; a percentile cannot be added: the worst replica's.
    assert dom["running"] == 8 and dom["kv-used"] == 80 and dom["kv-total"] == 200 and dom["kv-pct"] == 40.0
    assert dom["ttft-p50"] == 400.0 and dom["steps"] == int(field("0", "steps")) + int(field("1", "steps"))
    # Each replica's charts are drawn (some pixels are not blank).
    inked = browser.execute_script("""
        return [...document.querySelectorAll('[data-replica="0"] canvas, [data-replica="1"] canvas')].map((c) => {
          const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
          let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; });""")
    assert len(inked) == 4 and min(inked) > 500, inked
