"""The chat page at ``/``, used as a person would in a real headless Chromium (Debian's, installed by
`make setup`): against a running `ferry serve --api-key`, and against a scripted API for what the
small model cannot show (reasoning, several models, errors mid-stream).

Screenshots of a conversation, wide and narrow, are saved under the temp directory (the paths are printed).
"""
from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from typing import Any, Callable

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from ferry.server.chat_page import chat_page_router
from tests.test_dashboard import browser, wait_until  # noqa: F401 (browser: the module-scoped Chromium fixture)
from tests.test_server import MODEL, metric, server, serve_in_thread, wait_idle

KEY = "chat-sekret"
KEY_STORE = "ferry.chat.key"  # the page's sessionStorage item
SCREENSHOT, NARROW_SCREENSHOT = (os.path.join(tempfile.gettempdir(), name)
                                 for name in ("ferry-chat.png", "ferry-chat-narrow.png"))

# What the page shows, read from its DOM: the conversation, the buttons, the key panel, the notice.
READ_CHAT = """
const q = (s) => document.querySelector(s);
const body = (m) => m.querySelector('.content') || m.querySelector('.bubble');
const reasoning = (m) => m.querySelector('.reasoning');
return {
  messages: [...document.querySelectorAll('#log .msg')].map((m) => ({
    role: m.dataset.role, state: m.dataset.state || null, text: body(m).textContent, html: body(m).innerHTML,
    reasoning: reasoning(m) && !reasoning(m).hidden ? m.querySelector('.reasoning-body').textContent : null,
    reasoning_open: Boolean(reasoning(m) && reasoning(m).open),
    meta: m.querySelector('.meta') ? m.querySelector('.meta').textContent : ''})),
  send_disabled: q('#send').disabled, cancel_shown: !q('#cancel').hidden,
  key_asked: !q('#key-panel').hidden, key_note: q('#key-note').textContent,
  notice: q('#notice').hidden ? '' : q('#notice').textContent,
  models: [...document.querySelectorAll('#model option')].map((o) => o.value), model: q('#model').value,
  input: q('#input').value, history: window.ferryChat.history.map((m) => ({...m})),
};
"""


def read_chat(driver) -> dict[str, Any]:
    return driver.execute_script(READ_CHAT)


def wait_chat(driver, check: Callable[[dict], bool], timeout: float, what: str) -> dict[str, Any]:
    return wait_until(lambda: read_chat(driver), check, timeout, what, every=0.1)


def open_page(driver, url: str, key: str | None = KEY) -> dict[str, Any]:
    """A fresh tab's state: the page loaded with ``key`` (or none) in its sessionStorage."""
    driver.get(url + "/")
    driver.execute_script("sessionStorage.clear(); "
                          "if (arguments[0]) sessionStorage.setItem(arguments[1], arguments[0]);", key, KEY_STORE)
    driver.refresh()
    return wait_chat(driver, lambda d: d["models"] or d["key_asked"], 60, "the models or the key form")


def type_message(driver, text: str) -> None:
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def settings(driver, max_tokens: int | None = None, temperature: float | None = None, extra: dict | None = None,
             system: str = "") -> None:
    """Fill the settings the way a person does: open them, clear each field, type."""
    panel = driver.find_element(By.CSS_SELECTOR, "details.settings")
    if not panel.get_attribute("open"):
        panel.find_element(By.TAG_NAME, "summary").click()
    for field, value in (("max-tokens", max_tokens), ("temperature", temperature),
                         ("extra", json.dumps(extra) if extra else None), ("system", system or None)):
        el = driver.find_element(By.ID, field)
        el.clear()
        if value is not None:
            el.send_keys(str(value))


def wait_answer(driver, n: int, timeout: float = 240) -> tuple[dict, list[int]]:
    """Until the n-th assistant message is no longer streaming; the lengths it showed on the way."""
    lengths, deadline = [], time.time() + timeout
    while True:
        dom = read_chat(driver)
        answers = [m for m in dom["messages"] if m["role"] == "assistant"]
        if len(answers) >= n:
            lengths.append(len(answers[n - 1]["text"]))
            if answers[n - 1]["state"] != "streaming":
                return dom, lengths
        assert time.time() < deadline, f"answer {n} never ended: {dom}"
        time.sleep(0.05)


# ---------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def srv():
    with server("--api-key", KEY, "--max-num-seqs", "4") as proc:
        yield proc.url


def api_answer(url: str, messages: list[dict], max_tokens: int) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=300)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                       extra_body={"ignore_eos": True})
    return r.choices[0].message.content


def test_the_page_opens_without_the_key_and_asks_for_it(srv, browser):  # noqa: F811
    page = httpx.get(srv + "/", timeout=60)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="input"' in page.text and MODEL not in page.text  # the page holds no data
    policy = page.headers["content-security-policy"]
    assert "script-src 'sha256-" in policy and "connect-src 'self'" in policy and "default-src 'none'" in policy
    assert httpx.head(srv + "/", timeout=60).status_code == 200
    assert httpx.get(srv + "/v1/models", timeout=60).status_code == 401

    dom = open_page(browser, srv, key=None)
    assert dom["key_asked"] and "needs its API key" in dom["key_note"] and dom["models"] == []
    # A message sent without the key is refused: the key is asked for, the text waits in the box.
    type_message(browser, "Hello there")
    dom = wait_chat(browser, lambda d: not d["send_disabled"] and d["input"] == "Hello there", 60, "the text back")
    assert dom["messages"] == [] and dom["history"] == [] and dom["key_asked"]
    # A wrong key is refused and not kept; the right one is kept for the tab and lists the models.
    browser.find_element(By.ID, "key").send_keys("wrong", Keys.ENTER)
    dom = wait_chat(browser, lambda d: d["key_asked"] and "refused" in d["key_note"], 60, "the key refused")
    assert browser.execute_script(f"return sessionStorage.getItem('{KEY_STORE}')") is None
    browser.find_element(By.ID, "key").send_keys(KEY, Keys.ENTER)
    dom = wait_chat(browser, lambda d: d["models"] == [MODEL] and not d["key_asked"], 60, "the models")
    assert browser.execute_script(f"return sessionStorage.getItem('{KEY_STORE}')") == KEY
    # Its own style and script run (by hash); a script slipped into the page does not.
    assert browser.execute_script("return getComputedStyle(document.querySelector('header')).backgroundColor") \
        == "rgb(29, 35, 48)"
    browser.execute_script("const s = document.createElement('script'); s.textContent = 'window.slipped = 1';"
                           "document.body.append(s);")
    assert browser.execute_script("return window.slipped === undefined")


def test_an_answer_streams_in_and_the_next_turn_carries_the_conversation(srv, browser):  # noqa: F811
    open_page(browser, srv)
    settings(browser, max_tokens=48, temperature=0, extra={"ignore_eos": True})
    type_message(browser, "Tell me about the sea.")
    dom, lengths = wait_answer(browser, 1)
    first = dom["messages"][1]
    assert first["state"] == "done" and dom["notice"] == "", dom
    # Seen growing: several partial lengths before the whole answer.
    partial = sorted(set(n for n in lengths[:-1] if 0 < n < lengths[-1]))
    assert len(partial) >= 2, lengths
    assert first["meta"].startswith("48 tokens") and "max tokens reached" in first["meta"]
    assert not dom["send_disabled"] and not dom["cancel_shown"]
    # Every streamed piece arrived: the answer is the one the API gives whole.
    question = {"role": "user", "content": "Tell me about the sea."}
    want = api_answer(srv, [question], 48)
    assert dom["history"] == [question, {"role": "assistant", "content": want}]

    type_message(browser, "Say it again, shorter.")
    dom, _ = wait_answer(browser, 2)
    assert [m["role"] for m in dom["messages"]] == ["user", "assistant", "user", "assistant"]
    assert dom["messages"][1]["text"] == first["text"] and dom["messages"][3]["state"] == "done"
    # The second request held the first turn: its answer is the API's for the whole conversation.
    again = {"role": "user", "content": "Say it again, shorter."}
    conversation = [question, {"role": "assistant", "content": want}, again]
    assert dom["history"] == conversation + [{"role": "assistant", "content": api_answer(srv, conversation, 48)}]
    assert api_answer(srv, [again], 48) != dom["history"][3]["content"]  # it was not answered alone

    browser.find_element(By.ID, "clear").click()
    dom = read_chat(browser)
    assert dom["messages"] == [] and dom["history"] == []


def test_cancel_ends_a_long_generation_on_the_server_too(srv, browser):  # noqa: F811
    open_page(browser, srv)
    aborted = metric(srv, "ferry:request_success_total", 'finished_reason="abort"')
    tokens = metric(srv, "ferry:generation_tokens_total")
    settings(browser, max_tokens=4000, temperature=0, extra={"ignore_eos": True})
    type_message(browser, "Count from one to a thousand.")
    wait_chat(browser, lambda d: len(d["messages"]) == 2 and len(d["messages"][1]["text"]) >= 30 and d["cancel_shown"],
              120, "a long answer under way")
    browser.find_element(By.ID, "cancel").click()
    dom = wait_chat(browser, lambda d: not d["send_disabled"], 30, "the send button back")
    answer = dom["messages"][1]
    assert answer["state"] == "cancelled" and answer["meta"].startswith("cancelled") and not dom["cancel_shown"]
    assert dom["notice"] == "" and dom["history"][1]["content"]  # what came is kept for the next turn
    # The server aborted it on the disconnect, well short of its 4000 tokens.
    wait_idle(srv)
    assert metric(srv, "ferry:request_success_total", 'finished_reason="abort"') == aborted + 1
    assert metric(srv, "ferry:generation_tokens_total") - tokens < 4000
    time.sleep(0.5)
    assert read_chat(browser)["messages"][1]["text"] == answer["text"]  # and the answer grows no more
    # The page takes the next message at once.
    settings(browser, max_tokens=4, extra={"ignore_eos": True})
    type_message(browser, "Hi")
    dom, _ = wait_answer(browser, 2)
    assert dom["messages"][3]["state"] == "done" and dom["messages"][3]["meta"].startswith("4 tokens")


# ---------------------------------------------------------------- a scripted API
class ScriptedAPI:
    """``GET /v1/models`` lists two models; each ``POST /v1/chat/completions`` is recorded and answered
    with the next reply: a list of raw pieces of the event stream (sent apart, so events arrive
    split anywhere), or a (status, body) error."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.replies: list[Any] = []

    def app(self) -> FastAPI:
        app = FastAPI()
        app.include_router(chat_page_router())

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": name, "object": "model"} for name in SCRIPTED_MODELS]}

        @app.post("/v1/chat/completions")
        async def chat(raw: Request):
            self.bodies.append(await raw.json())
            reply = self.replies.pop(0)
            if isinstance(reply, tuple):
                return JSONResponse(reply[1], status_code=reply[0])

            async def pieces():
                for piece in reply:
                    yield piece if isinstance(piece, bytes) else piece.encode()
                    await asyncio.sleep(0.02)

            return StreamingResponse(pieces(), media_type="text/event-stream")

        return app


def chunk(**delta: str) -> str:
    return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": None}]}) + "\n\n"


def split_anywhere(stream: str, size: int = 7) -> list[bytes]:
    """The stream cut into pieces of ``size`` bytes: events, lines and UTF-8 characters split."""
    raw = stream.encode()
    return [raw[i:i + size] for i in range(0, len(raw), size)]


SCRIPTED_MODELS = [MODEL, "Qwen3-0.6B"]
REASONING = "The user greets me. I should greet back – politely."
ANSWER = "Hello! Here is code:\n\n```sh\necho '<hi>'\n```\n\n- **one**\n- ünïcödé ✓"
TOKENS_SHOWN = 12


@pytest.fixture(scope="module")
def scripted():
    api = ScriptedAPI()
    with serve_in_thread(api.app()) as url:
        api.url = url  # type: ignore[attr-defined]
        yield api


CRAFTED = """Here is **bold**, *slanted*, `a<b && c>d` and a [link](https://example.com/a?b=1&c=2).
No [script link](javascript:alert(1)) and no <script>window.pwned = 1</script>
<img src=x onerror="window.pwned = 2"> nor [quoted](https://x.y/" onmouseover="window.pwned = 3).

```python
print("<b>not bold</b>")  # & kept
```

- one
- two
  - nested

1. first
2. second
"""


def test_markdown_renders_and_no_markup_of_the_text_gets_through(scripted, browser):  # noqa: F811
    open_page(browser, scripted.url, key=None)
    html = browser.execute_script("return window.ferryChat.renderMarkdown(arguments[0])", CRAFTED)
    assert "<script" not in html and "<img" not in html and "&lt;script&gt;" in html
    # Put into the page as the page does with an answer, then read back as elements.
    got = browser.execute_script("""
        const box = document.createElement('div'); box.className = 'md'; box.innerHTML = arguments[0];
        document.getElementById('log').append(box);
        return {tags: [...box.querySelectorAll('*')].map((e) => e.tagName.toLowerCase()),
                links: [...box.querySelectorAll('a')].map((a) => [a.getAttribute('href'), a.textContent, a.rel]),
                attrs: [...box.querySelectorAll('*')].flatMap((e) => [...e.attributes].map((a) => a.name)),
                code: [...box.querySelectorAll('pre code')].map((c) => c.textContent),
                inline: [...box.querySelectorAll('p code')].map((c) => c.textContent),
                items: [...box.querySelectorAll('li')].map((li) => li.firstChild.textContent),
                lang: box.querySelector('.code-head span').textContent,
                strong: box.querySelector('strong').textContent, em: box.querySelector('em').textContent};""",
                                  html)
    assert "script" not in got["tags"] and "img" not in got["tags"]
    assert set(got["attrs"]) <= {"class", "href", "target", "rel", "type"}, got["attrs"]
    assert got["links"] == [["https://example.com/a?b=1&c=2", "link", "noopener noreferrer"]]
    assert got["code"] == ['print("<b>not bold</b>")  # & kept'] and got["lang"] == "python"
    assert got["inline"] == ["a<b && c>d"] and got["strong"] == "bold" and got["em"] == "slanted"
    assert got["items"] == ["one", "two", "nested", "first", "second"]
    assert browser.execute_script("return [document.querySelectorAll('#log ol').length, "
                                  "document.querySelectorAll('#log ul ul').length]") == [1, 1]
    time.sleep(0.3)  # an image's onerror would have fired by now
    assert browser.execute_script("return window.pwned === undefined")
    # A fence still open (the answer is streaming) is code to the end.
    assert browser.execute_script("return window.ferryChat.renderMarkdown(arguments[0])",
                                  "Look:\n```js\nlet a = '<i>'") \
        == ('<p>Look:</p><div class="code"><div class="code-head"><span>js</span><button type="button" '
            'class="copy">Copy</button></div><pre><code>let a = &#39;&lt;i&gt;&#39;</code></pre></div>')


def test_reasoning_models_and_errors_against_a_scripted_api(scripted, browser):  # noqa: F811
    dom = open_page(browser, scripted.url, key=None)
    assert dom["models"] == SCRIPTED_MODELS and not dom["key_asked"]  # a server without a key asks for none
    browser.find_element(By.CSS_SELECTOR, "#model option[value='Qwen3-0.6B']").click()
    stream = "".join([chunk(role="assistant", content="")]
                     + [chunk(reasoning_content=w, reasoning=w) for w in REASONING.split(" ")[:1]]
                     + [chunk(reasoning_content=" " + w, reasoning=" " + w) for w in REASONING.split(" ")[1:]]
                     + [chunk(content=ANSWER[i:i + 5]) for i in range(0, len(ANSWER), 5)]
                     + ["data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 5,
                                                                        "completion_tokens": TOKENS_SHOWN}}) + "\n\n",
                        "data: [DONE]\n\n"])
    scripted.replies.append(split_anywhere(stream))
    settings(browser, system="Be brief.")
    type_message(browser, "Hi")
    dom, _ = wait_answer(browser, 1, 60)
    answer = dom["messages"][1]
    assert answer["state"] == "done" and dom["notice"] == ""
    assert answer["reasoning"] == REASONING and not answer["reasoning_open"]  # shown, collapsed
    assert "ünïcödé ✓" in answer["text"] and "<strong>one</strong>" in answer["html"]
    assert "echo '<hi>'" in answer["text"] and "&lt;hi&gt;" in answer["html"]
    assert answer["meta"].startswith(f"{TOKENS_SHOWN} tokens")
    body = scripted.bodies[-1]
    assert body["model"] == "Qwen3-0.6B" and body["stream"] is True
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    # The next turn sends the whole conversation, without the reasoning.
    scripted.replies.append([chunk(content="Again.") + "data: [DONE]\n\n"])
    type_message(browser, "Once more")
    dom, _ = wait_answer(browser, 2, 60)
    assert scripted.bodies[-1]["messages"][1:] == [{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": ANSWER},
                                                   {"role": "user", "content": "Once more"}]
    assert dom["messages"][3]["reasoning"] is None  # no reasoning: no empty box

    # A field the server refuses: its message, naming the field; the turn is undone, the text kept.
    scripted.replies.append((400, {"error": {"message": "max_tokens must be at least 1", "type": "invalid_request_error",
                                             "param": "max_tokens", "code": None}}))
    type_message(browser, "A third")
    dom = wait_chat(browser, lambda d: d["notice"] and not d["send_disabled"], 60, "the error")
    assert dom["notice"] == "max_tokens: max_tokens must be at least 1" and dom["input"] == "A third"
    assert len(dom["messages"]) == 4 and len(dom["history"]) == 4
    # An error event mid-stream: shown, and what came before it is kept.
    scripted.replies.append(split_anywhere(chunk(content="Partial") + "data: " + json.dumps(
        {"error": {"message": "the engine step failed: boom", "type": "server_error", "param": None}})
        + "\n\ndata: [DONE]\n\n"))
    browser.find_element(By.ID, "input").send_keys(Keys.ENTER)  # the text is still in the box
    dom = wait_chat(browser, lambda d: d["notice"] and len(d["messages"]) == 6 and not d["send_disabled"], 60,
                    "the error mid-stream")
    assert dom["notice"] == "the engine step failed: boom" and dom["messages"][5]["state"] == "error"
    assert dom["messages"][5]["text"] == "Partial" and dom["history"][-1]["content"] == "Partial"
    # More request fields that are not a JSON object are refused before anything is sent.
    sent = len(scripted.bodies)
    settings(browser, system="Be brief.", extra=None)
    browser.find_element(By.ID, "extra").send_keys("[1, 2]")
    type_message(browser, "Four")
    dom = read_chat(browser)
    assert "not a JSON object" in dom["notice"] and len(scripted.bodies) == sent and dom["input"] == "Four"


def test_screenshots_wide_and_narrow(scripted, browser):  # noqa: F811
    open_page(browser, scripted.url, key=None)
    scripted.replies.append(split_anywhere("".join(
        [chunk(reasoning_content=REASONING)]
        + [chunk(content=ANSWER + "\n\nAnd a [link](https://example.com) with `inline code`.")]
        + ["data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 42}}) + "\n\n", "data: [DONE]\n\n"])))
    type_message(browser, "Hi! Show me a shell one-liner, please.")
    wait_answer(browser, 1, 60)
    browser.find_element(By.CSS_SELECTOR, "details.reasoning summary").click()  # opened for the picture
    browser.save_screenshot(SCREENSHOT)
    print("screenshot:", SCREENSHOT)
    try:
        browser.set_window_size(390, 800)
        time.sleep(0.3)
        # Nothing wider than a phone's window: no sideways scrolling of the page.
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        assert browser.find_element(By.ID, "send").is_displayed()
        browser.save_screenshot(NARROW_SCREENSHOT)
        print("screenshot:", NARROW_SCREENSHOT)
    finally:
        browser.set_window_size(1280, 1000)
