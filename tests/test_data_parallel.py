"""Data-parallel replicas on Ray behind one endpoint (`ferry serve --data-parallel-size 2`): both
replicas serve, the router's policies hold on the real server, metrics and the dashboard state
are per replica, and killing one replica's actor leaves the endpoint serving."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import openai

from ferry import SamplingParams

from tests.test_dashboard import browser  # noqa: F401 - the Chromium fixture
from tests.test_server import MODEL, free_port, wait_until_up


@contextmanager
def dp_server(*extra: str):
    """`ferry serve` with 2 replicas; stopped with SIGTERM (which stops its Ray cluster), then its
    whole process group is killed whatever is left."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ferry.cli", "serve", "--port", str(port), "--log-level", "warning",
                             "--data-parallel-size", "2", "--max-num-seqs", "8", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url, 240)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def state(url: str) -> list[dict]:
    return httpx.get(url + "/dashboard/state", timeout=30).json()["replicas"]


def routed(url: str) -> list[int]:
    return [r["routed"] for r in state(url)]


def complete(url: str, prompt: str | list[int], max_tokens: int = 4) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def replica_running_on_page(driver, replica: int) -> str:
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, f'[data-replica="{replica}"] [data-field="running"]')
    return found[0].text if found else ""


def test_prefix_aware_routing_metrics_and_state_per_replica(llm, browser):
    with dp_server("--router-policy", "prefix_aware") as url:
        reps = state(url)
        assert [r["replica"] for r in reps] == ["0", "1"] and all(r["alive"] for r in reps)
        assert reps[0]["pid"] != reps[1]["pid"]
        # The same greedy text as one engine in this process.
        ref = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)[0].outputs[0].text
        assert complete(url, "The capital of France is", 8) == ref
        # A long shared prefix (system prompt) goes where it is cached, request after request.
        prefix = list(range(1000, 1000 + 96))
        before = routed(url)
        complete(url, prefix + [7, 8, 9])
        holder = [a - b for a, b in zip(routed(url), before)].index(1)
        for k in range(3):
            complete(url, prefix + [20 + k, 30 + k])
        after = routed(url)
        assert after[holder] - before[holder] == 4 and after[1 - holder] == before[1 - holder]
        # A new prompt with no cached prefix goes to the least-loaded replica: while a long
        # request runs on one, it goes to the other.
        client = httpx.Client(timeout=120)
        with client.stream("POST", url + "/v1/completions", json={
                "model": MODEL, "prompt": prefix + [300, 301], "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as resp:
            lines = resp.iter_lines()  # kept: a dropped iterator closes the response, which aborts
            next(lines)
            busy = holder
            assert state(url)[busy]["in_flight"] == 1
            mid = routed(url)
            complete(url, list(range(5000, 5040)))
            assert routed(url)[1 - busy] == mid[1 - busy] + 1
            # The dashboard, in Chromium, shows each replica: the busy one running its request.
            browser.get(url + "/dashboard")
            deadline = time.time() + 30
            while replica_running_on_page(browser, busy) != "1" or replica_running_on_page(browser, 1 - busy) != "0":
                assert time.time() < deadline, "the page never showed the two replicas' running requests"
                time.sleep(0.2)
            shot = os.environ.get("FERRY_DASHBOARD_REPLICAS_SCREENSHOT")
            if shot:  # docs/dashboard-replicas.png
                time.sleep(3)
                browser.save_screenshot(shot)
        # Metrics carry a replica label; both replicas finished requests.
        text = httpx.get(url + "/metrics", timeout=30).text
        for r in ("0", "1"):
            line = next(l for l in text.splitlines()
                        if l.startswith("ferry:request_success_total") and f'replica="{r}"' in l and "length" in l)
            assert float(line.rsplit(" ", 1)[1]) >= 1
            assert f'ferry:replica_up{{model_name="{MODEL}",replica="{r}"}} 1.0' in text
        # Tools and the other protocols go through the replicas as through one engine.
        from tests.test_server_tools import ASK, NAMED, TOOLS

        oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        call = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=60, temperature=0).choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
        assert oai.responses.create(model=MODEL, input="hi", max_output_tokens=2).output
        assert httpx.post(url + "/v1/messages/count_tokens", json={"messages": ASK}).json()["input_tokens"] > 5
        emb = oai.embeddings.create(model=MODEL, input=["one", "two"]).data
        assert len(emb) == 2 and abs(sum(x * x for x in emb[0].embedding) - 1) < 1e-4
        assert 'endpoint="/v1/chat/completions"' in httpx.get(url + "/metrics", timeout=30).text
        # A replica that dies before its request streamed anything: the request moves to the other
        # replica and succeeds (a long prompt keeps it in prefill, with no output, for seconds).
        long_prompt = [1000 + (7 * i) % 20000 for i in range(3000)]
        before = routed(url)
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(text=complete(url, long_prompt, 4)))
        worker.start()
        deadline = time.time() + 30
        while not any(r["in_flight"] for r in state(url)):
            assert time.time() < deadline
            time.sleep(0.05)
        reps = state(url)
        victim = next(int(r["replica"]) for r in reps if r["in_flight"])
        os.kill(reps[victim]["pid"], signal.SIGKILL)
        worker.join(120)
        assert result.get("text"), "the request was not retried on the surviving replica"
        after = routed(url)
        assert after[victim] == before[victim] + 1 and after[1 - victim] == before[1 - victim] + 1
        assert not state(url)[victim]["alive"]


def test_round_robin_and_a_killed_replica_leaves_the_endpoint_serving():
    with dp_server("--router-policy", "round_robin") as url:
        start = routed(url)
        for i in range(4):
            complete(url, f"Count to {i}:")
        assert [a - b for a, b in zip(routed(url), start)] == [2, 2]
        # A streaming request on replica 1 when it dies ends with an error event naming it.
        client = httpx.Client(timeout=120)
        victim = None
        with client.stream("POST", url + "/v1/completions", json={
                "model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as resp:
            lines = resp.iter_lines()
            next(l for l in lines if l.startswith("data:"))
            reps = state(url)
            victim = next(int(r["replica"]) for r in reps if r["in_flight"] == 1)
            os.kill(reps[victim]["pid"], signal.SIGKILL)
            events = [l for l in lines if l.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][5:])["error"]
        assert f"replica {victim} died" in error["message"]
        # The router stops sending it traffic; the endpoint keeps serving.
        deadline = time.time() + 30
        while state(url)[victim]["alive"] and time.time() < deadline:
            time.sleep(0.2)
        assert not state(url)[victim]["alive"]
        before = routed(url)
        for i in range(3):
            assert complete(url, f"Name a colour {i}:")
        after = routed(url)
        assert after[victim] == before[victim] and after[1 - victim] == before[1 - victim] + 3
        assert httpx.get(url + "/health").status_code == 200
        text = httpx.get(url + "/metrics", timeout=30).text
        assert f'ferry:replica_up{{model_name="{MODEL}",replica="{victim}"}} 0.0' in text
