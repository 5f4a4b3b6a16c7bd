"""Structured outputs (grammar-constrained sampling) on the embedded model."""
from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry import SamplingParams
from ferry.core.outputs import ScheduledChunk
from ferry.executor.request_state import CachedRequest
from ferry.core.sampling_params import StructuredOutputs as SO
from ferry.executor.sampler import Sampler
from ferry.executor.structured import GrammarCompiler

PROMPT = "Here is the record as JSON:\n"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "role": {"enum": ["guest", "user", "root"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        "home": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                 "required": ["zip"]},
    },
    "required": ["name", "age", "admin", "role", "tags", "home"],
}
INSTANCE = {"name": "Ada", "age": 36, "admin": True, "role": "root", "tags": ["math"], "home": {"zip": 12345}}


def check(value: object, schema: dict) -> None:
    """Assert ``value`` validates against ``schema`` (the keywords these tests use)."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict), value
        assert set(schema.get("required", [])) <= set(value), (value, schema)
        for key, sub in schema["properties"].items():
            if key in value:
                check(value[key], sub)
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value)), value
        for item in value:
            check(item, schema["items"])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)), value
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), (value, schema)
    elif kind == "boolean":
        assert isinstance(value, bool), value
    else:
        raise AssertionError(f"check() does not know {kind!r}")


def max_tokens_for(schema: dict) -> int:
    """An upper bound on the tokens of any output of ``schema`` (the grammar writes no free
    whitespace; every token is at least one byte and a string character at most 12: a \\u escape
    pair), plus the end-of-sequence token: a cap that never cuts a valid completion short."""
    def chars(s: dict) -> int:
        if "enum" in s:
            return max(len(json.dumps(v)) for v in s["enum"]) * 6
        kind = s["type"]
        if kind == "object":
            return 2 + sum(len(json.dumps(k)) * 6 + 4 + chars(v) for k, v in s["properties"].items())
        if kind == "array":
            return 2 + s["maxItems"] * (chars(s["items"]) + 2)
        if kind == "string":
            return 2 + 12 * s["maxLength"]
        if kind == "integer":
            return max(len(str(s["minimum"])), len(str(s["maximum"])))
        return 5  # boolean
    return chars(schema) + 1


def run(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def sampled(so: SO, max_tokens: int, seeds=(0, 1, 2)) -> list[SamplingParams]:
    """Greedy, then temperature 1.0 with each seed."""
    return [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)] + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=so) for s in seeds]


CHOICES = ["red", "green", 'say "hi"', "naïve"]
REGEX = r"[A-Z][a-z]{1,6}-[0-9]{2,3}"
EBNF = 'root ::= "The answer is " ("yes" | "no") "."'
PLAIN_PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
PLAIN = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def batch(llm):
    """Every kind of spec, greedy and sampled, and two plain greedy requests, in one batch: one
    run of decode steps instead of one per test (each test below checks its own part)."""
    from ferry.model.tokenizer import apply_chat_template

    # A chat prompt asking for a small object: free JSON sampled at temperature 1 from a bare
    # prompt can run on past any cap.
    obj_prompt = apply_chat_template(llm.tokenizer, [
        {"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}])
    parts = {
        "json": ([PROMPT] * 5, sampled(SO(json=SCHEMA), max_tokens_for(SCHEMA)) + [SamplingParams(
            temperature=1.0, seed=9, max_tokens=max_tokens_for(SCHEMA), structured_outputs=SO(json=json.dumps(SCHEMA)))]),
        "json_object": ([obj_prompt] * 4, sampled(SO(json_object=True), 32)),
        "regex": ([PROMPT] * 4, sampled(SO(regex=REGEX), 24)),
        "choice": ([PROMPT] * 4, sampled(SO(choice=CHOICES), 8)),
        "grammar": (["Question: is the sky blue?\n"] * 3, sampled(SO(grammar=EBNF), 12, seeds=(0, 1))),
        "plain": (PLAIN_PROMPTS, [PLAIN] * 2),
    }
    prompts = [p for ps, _ in parts.values() for p in ps]
    params = [sp for _, sps in parts.values() for sp in sps]
    outs = run(llm, prompts, params)
    result, i = {}, 0
    for name, (ps, _) in parts.items():
        result[name] = outs[i:i + len(ps)]
        i += len(ps)
    return result


def test_json_schema_greedy_and_sampled(batch):
    for out in batch["json"]:
        assert out.finish_reason == "stop", out.text
        check(json.loads(out.text), SCHEMA)


def test_json_object(batch):
    for out in batch["json_object"]:
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict)


def test_regex(batch):
    for out in batch["regex"]:
        assert re.fullmatch(REGEX, out.text), out.text


def test_choice(batch):
    assert all(out.text in CHOICES for out in batch["choice"]), [o.text for o in batch["choice"]]
    assert len({o.text for o in batch["choice"]}) > 1  # the sampled ones do sample


def test_ebnf_grammar(batch):
    assert all(re.fullmatch(r"The answer is (yes|no)\.", o.text) for o in batch["grammar"]), \
        [o.text for o in batch["grammar"]]


def test_plain_requests_unchanged_by_grammar_neighbours(llm, batch):
    alone = run(llm, PLAIN_PROMPTS, PLAIN)
    assert [o.token_ids for o in batch["plain"]] == [o.token_ids for o in alone]


@pytest.mark.parametrize("spec, field", [
    (dict(json={"type": "strng"}), "structured_outputs.json"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "structured_outputs.json"),
    (dict(regex="(ab"), "structured_outputs.regex"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
])
def test_invalid_spec_raises_naming_the_field(llm, spec, field):
    sp = SamplingParams(max_tokens=4, structured_outputs=SO(**spec))
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=4), sp], use_tqdm=False)
    assert not llm.engine.has_unfinished()  # nothing was queued


@pytest.mark.parametrize("spec, field", [
    (dict(), "exactly one"),
    (dict(json={}, regex="a"), "json and regex"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json="[1, 2]"), "structured_outputs.json"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", 3]), "structured_outputs.choice"),
    (dict(regex=""), "structured_outputs.regex"),
])
def test_malformed_spec_raises_naming_the_field(spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        SO(**spec)


def test_a_model_without_tokenizer_refuses_structured_outputs():
    with pytest.raises(ValueError, match="tokenizer"):
        GrammarCompiler(None, 100, [1]).validate(SO(regex="[a-z]+"))


def test_matchers_are_dropped_when_requests_finish_or_abort(llm):
    sampler = llm.engine.executor.sampler
    run(llm, [PROMPT], SamplingParams(max_tokens=4, structured_outputs=SO(regex="[a-z]{8}")))
    llm.engine.add_request(PROMPT, SamplingParams(max_tokens=50, structured_outputs=SO(json_object=True)),
                           request_id="to-abort")
    llm.engine.step()
    assert "to-abort" in sampler._matchers
    llm.engine.abort("to-abort")
    run(llm, [PROMPT], SamplingParams(max_tokens=2))  # its first step forgets the finished ones
    assert not sampler._matchers


def test_a_queued_request_keeps_its_grammar_when_the_cache_drops_it(llm, monkeypatch):
    """The step loop never compiles: a grammar evicted from the cache while its request waited
    (or while its matcher was dropped) is still the request's own."""
    grammars = llm.engine.executor.grammars
    monkeypatch.setattr(grammars, "cache_size", 1)
    spec = SO(regex="[0-9]{3}-[a-z]{3}")
    llm.engine.add_request(PROMPT, SamplingParams(max_tokens=8, structured_outputs=spec), request_id="held")
    grammars.validate(SO(regex="[q-z]{2,9}"))  # a later request's compile evicts the first
    assert ("regex", spec.regex) not in grammars._cache
    compiles = grammars.num_compiles
    monkeypatch.setattr(grammars, "compile", lambda s: pytest.fail("compiled on the step loop"))
    outs = {}
    while llm.engine.has_unfinished():
        outs.update({o.request_id: o for o in llm.engine.step()})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{3}", outs["held"].outputs[0].text)
    assert grammars.num_compiles == compiles
    run(llm, [PROMPT], SamplingParams(max_tokens=1))  # its first step lets go of the finished one
    assert "held" not in grammars._held


def test_a_grammar_compiled_in_one_process_loads_in_another(llm):
    """A tensor-parallel driver hands rank 0 its compiled grammars: loaded, not compiled again,
    and allowing exactly what the original allows."""
    ex = llm.engine.executor
    spec = SO(json=SCHEMA)
    ex.grammars.hold("r", ex.grammars.validate(spec))
    other = GrammarCompiler(ex.tokenizer, ex.vocab_size, ex.eos_token_ids)
    other.hold_serialized("r", ex.grammars.serialized("r"))
    a, b = ex.grammars.new_request(spec, "r"), other.new_request(spec, "r")
    assert other.num_compiles == 0
    toks = llm.tokenizer.encode(json.dumps(INSTANCE))
    for k in (0, 1, 5, len(toks)):
        assert torch.equal(_allowed(a, toks[:k], ex.vocab_size), _allowed(b, toks[:k], ex.vocab_size))
    ex.grammars.release(["r"])
    other.close()


def _allowed(grammar, prefix: list[int], vocab: int) -> torch.Tensor:
    row = torch.zeros(vocab)
    grammar.mask(row, prefix)
    return torch.isfinite(row)


def test_rollback_equals_a_fresh_matcher(llm):
    grammars, vocab = llm.engine.executor.grammars, llm.engine.executor.vocab_size
    spec = SO(json=SCHEMA)
    toks = llm.tokenizer.encode(json.dumps(INSTANCE))
    g = grammars.new_request(spec)
    for k, t in enumerate(toks):  # the instance is allowed token by token
        assert _allowed(g, toks[:k], vocab)[t]
        g.advance(t)
    assert g.num_consumed == len(toks)
    # Once the object is closed only end-of-sequence may follow.
    assert torch.nonzero(_allowed(g, toks, vocab)).flatten().tolist() == sorted(grammars.stop_token_ids)
    # Asked as if fewer tokens had been produced (a retried step), then more again (a replay).
    for n in (len(toks) - 1, 5, 0, 9, 3):
        fresh = grammars.new_request(spec)
        for t in toks[:n]:
            fresh.advance(t)
        want = _allowed(fresh, toks[:n], vocab)
        assert 0 < int(want.sum()) < vocab and want[toks[n]]
        assert torch.equal(_allowed(g, toks[:n], vocab), want), n
        assert g.num_consumed == n
    # A token outside the mask (never sampled, but a bug could) ends the grammar: only
    # end-of-sequence may follow, and it is rolled back like any other.
    wrong = int(torch.nonzero(~want)[0])
    g.advance(wrong)
    assert g.is_terminated
    assert torch.nonzero(_allowed(g, toks[:n] + [wrong], vocab)).flatten().tolist() == sorted(grammars.stop_token_ids)
    assert torch.equal(_allowed(g, toks[:n], vocab), want)


def test_retried_step_samples_the_same_token(llm):
    """A step that fails after sampling is run again with the request unchanged: its matcher
    must not have moved on."""
    sampler = Sampler(grammars=llm.engine.executor.grammars)
    sp = SamplingParams(temperature=0, structured_outputs=SO(regex="[a-z]{3}[0-9]{3}"))
    req = CachedRequest("r", [1, 2, 3], sp, eos_token_ids=tuple(llm.engine.eos_token_ids))
    logits = torch.randn(1, llm.engine.executor.vocab_size, generator=torch.Generator().manual_seed(0))
    text = ""
    for _ in range(8):
        chunk = ScheduledChunk("r", start=len(req.all_token_ids) - 1, num_tokens=1, new_block_ids=[], samples=True)
        first, _ = sampler.sample(logits, [(req, chunk)])
        again, _ = sampler.sample(logits, [(req, chunk)])  # the retry
        assert first == again
        req.output_token_ids += first["r"]
        req.all_token_ids += first["r"]
        text = llm.tokenizer.decode(req.output_token_ids)
        if first["r"][0] in req.eos_token_ids:
            break
    assert re.fullmatch("[a-z]{3}[0-9]{3}", text), text


# ------------------------------------------------------------------ random schemas
_enum_values = st.one_of(st.sampled_from(["a", "red", "x y", 'q"uote', "é"]), st.integers(-5, 500))
_leaf = st.one_of(
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-100, 100), st.integers(0, 300)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.lists(_enum_values, min_size=1, max_size=4, unique=True).map(lambda vs: {"enum": vs}),
)


def _object(children):
    return st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": list(props)})


_schemas = _object(st.recursive(_leaf, lambda c: st.one_of(
    _object(c), st.tuples(c, st.integers(0, 2)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]})),
    max_leaves=4))


# Each example runs several schemas in one batch: decode steps, not schemas, cost the time here.
@settings(max_examples=3, deadline=None)
@given(schemas=st.lists(_schemas, min_size=5, max_size=5), seed=st.integers(0, 2**32))
def test_random_schemas_validate(llm, schemas, seed):
    params = [SamplingParams(temperature=1.0, seed=seed + k, max_tokens=max_tokens_for(schema),
                             structured_outputs=SO(json=schema)) for k, schema in enumerate(schemas)]
    for schema, out in zip(schemas, run(llm, [PROMPT] * len(schemas), params)):
        assert out.finish_reason == "stop", (schema, out.text)
        check(json.loads(out.text), schema)
