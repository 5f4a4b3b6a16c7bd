"""``POST /v1/embeddings`` with the official openai SDK (which asks for base64 and decodes it) and
plain HTTP (floats), against an in-process server on the embedded model."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from ferry import SamplingParams
from tests.test_server import MODEL, serve_in_thread

TEXTS = ["The capital of France is Paris.", "Cats sleep for most of the day."]


@pytest.fixture(scope="module")
def url(llm):
    from ferry.engine.async_engine import AsyncEngine
    from ferry.engine.llm_engine import LLMEngine
    from ferry.server.app import build_app

    engine = AsyncEngine(LLMEngine.from_config(llm.config, llm.engine.executor))
    with serve_in_thread(build_app(engine, MODEL)) as u:
        yield u


def test_the_sdk_gets_the_engines_normalised_embeddings(llm, url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    res = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK sends encoding_format=base64
    assert [d.index for d in res.data] == [0, 1] and res.model == MODEL
    for d, o in zip(res.data, llm.embed(TEXTS, use_tqdm=False)):
        v = torch.tensor(d.embedding)
        assert v.shape == (576,) and abs(float(v.norm()) - 1) < 1e-5
        assert float((v - torch.tensor(o)).abs().max()) < 1e-5
    ids = llm.tokenizer.encode(TEXTS[0])
    assert res.usage.prompt_tokens == res.usage.total_tokens == len(ids) + len(llm.tokenizer.encode(TEXTS[1]))
    by_ids = client.embeddings.create(model=MODEL, input=[ids])
    assert float((torch.tensor(by_ids.data[0].embedding) - torch.tensor(res.data[0].embedding)).abs().max()) < 1e-5


def test_floats_mean_pooling_and_bad_input(llm, url):
    r = httpx.post(url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "float", "pooling": "mean"},
                   timeout=60)
    assert r.status_code == 200, r.text
    got = torch.tensor(r.json()["data"][0]["embedding"])
    want = llm.generate([TEXTS[0]], SamplingParams(pooling="mean"), use_tqdm=False)[0].embedding
    assert float((got - torch.tensor(want)).abs().max()) < 1e-5
    for body, param in [({"input": []}, "input"), ({"input": ""}, "input"), ({"input": "x", "dimensions": 64}, "dimensions"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "x", "model": "other"}, "model")]:
        r = httpx.post(url + "/v1/embeddings", json=body, timeout=30)
        assert r.status_code in (400, 404, 422) and r.json()["error"]["param"] in (param, f"body.{param}"), (body, r.text)
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert 'endpoint="/v1/embeddings"' in metrics


def test_an_embedding_reserves_no_room_past_its_prompt(llm):
    room = llm.engine.config.max_model_len
    prompt = [(7 * i) % 20000 + 100 for i in range(room - 3)]  # 16 generated tokens would not fit
    [vector] = llm.embed([prompt], use_tqdm=False)
    assert len(vector) == 576
