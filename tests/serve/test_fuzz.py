"""A property-based fuzz of the request schema against a real `kubetune serve` process: no
body, however wrong, gets a 5xx, hangs, or leaves the engine dead."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

# any Unicode, lone surrogates and NUL included
TEXT = st.text(st.characters(codec=None, categories=None), max_size=40)
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), TEXT, st.lists(st.integers(), max_size=3)
)
COUNT = st.one_of(st.integers(-3, 24), JUNK)
NUMBER = st.one_of(st.floats(-1, 3), st.floats(allow_nan=True, allow_infinity=True), JUNK)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "developer", "tool"]), JUNK)},
    optional={
        "tool_call_id": st.one_of(TEXT, JUNK),
        "content": st.one_of(
            TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2), JUNK
        ),
    },
)
COMMON = {
    "max_tokens": COUNT,
    "temperature": NUMBER,
    "top_p": NUMBER,
    "seed": st.one_of(st.integers(-(2**66), 2**66), JUNK),
    "stream": st.one_of(st.booleans(), JUNK),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), JUNK),
    "n": COUNT,
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), JUNK)}), JUNK),
}
TOKEN = st.one_of(st.integers(-2, 50_000), JUNK)
SCHEMA = st.one_of(
    st.just({"type": "object"}),
    st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["object", "string", "integer", "array"]), JUNK)}),
    st.dictionaries(TEXT, JUNK, max_size=2),
    JUNK,
)
FORMAT = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}),
    st.fixed_dictionaries(
        {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"name": TEXT, "schema": SCHEMA})}
    ),
    JUNK,
)
TOOL = st.fixed_dictionaries(
    {
        "type": st.one_of(st.just("function"), JUNK),
        "function": st.fixed_dictionaries({"name": TEXT}, optional={"parameters": SCHEMA}),
    }
)
COMMON |= {
    "logit_bias": st.one_of(
        st.dictionaries(st.one_of(st.integers(-1, 60_000).map(str), TEXT), NUMBER, max_size=3), JUNK
    ),
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "repetition_penalty": NUMBER,
    "min_tokens": COUNT,
    "ignore_eos": st.one_of(st.booleans(), JUNK),
    "top_k": COUNT,
    "min_p": NUMBER,
    "stop_token_ids": st.one_of(st.lists(TOKEN, max_size=3), JUNK),
    "response_format": FORMAT,
}
MODEL = st.one_of(st.just("run-a"), st.just("qv"), TEXT, JUNK)
COMPLETION = st.fixed_dictionaries(
    {"model": MODEL},
    optional={
        "prompt": st.one_of(TEXT, st.lists(TEXT, max_size=2), st.lists(TOKEN, max_size=4), JUNK),
        "logprobs": COUNT,
        "echo": st.one_of(st.booleans(), JUNK),
        **COMMON,
    },
)
CHAT = st.fixed_dictionaries(
    {"model": MODEL},
    optional={
        "messages": st.one_of(st.lists(MESSAGE, max_size=3), JUNK),
        "logprobs": st.one_of(st.booleans(), JUNK),
        "top_logprobs": COUNT,
        "tools": st.one_of(st.lists(TOOL, max_size=2), JUNK),
        "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), JUNK),
        **COMMON,
    },
)


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(endpoint=st.sampled_from(["completions", "chat/completions"]), completion=COMPLETION, chat=CHAT)
def test_no_request_gets_a_5xx_or_kills_the_engine(tiny_server, endpoint, completion, chat):
    body = completion if endpoint == "completions" else chat
    r = httpx.post(
        f"{tiny_server.url}/v1/{endpoint}",
        content=json.dumps(body).encode(),  # NaN and lone surrogates as Python's json writes them
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code < 500, (body, r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200


# --- JSON schemas for structured output -------------------------------------------------------
# What the grammar library may refuse, at compile time or at the answer's first step: recursions
# with and without a way out, keywords it does not implement, huge enums, wrong types, deep nesting.
NAME = st.sampled_from(["a", "b", "c"])
TYPE = st.one_of(
    st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array"]),
    st.sampled_from(["objectx", "int", ""]),
    JUNK,
)
LEAF = st.one_of(
    st.fixed_dictionaries({"type": TYPE}),
    st.sampled_from([{"$ref": "#"}, {"$ref": "#/$defs/a"}, {"$ref": "#/$defs/missing"}, {"$ref": "http://x/s.json"}]),
    st.sampled_from(
        [{"not": {}}, {"if": {"type": "string"}}, {"uniqueItems": True}, {"patternProperties": {"^a": {}}}]
    ),
    st.fixed_dictionaries({"type": st.just("string")}, optional={"format": TEXT, "pattern": TEXT, "minLength": COUNT}),
    st.fixed_dictionaries({"type": st.just("integer")}, optional={"minimum": NUMBER, "maximum": NUMBER}),
    st.integers(0, 3000).map(lambda n: {"enum": [f"v{i}" for i in range(n)]}),
    st.one_of(TEXT, st.integers(), st.lists(st.integers(), max_size=3)).map(lambda v: {"const": v}),
    st.integers(1, 400).map(lambda depth: json.loads('{"type": "array", "items": ' * depth + "{}" + "}" * depth)),
    st.booleans(),
)


def _compound(child: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(NAME, child, max_size=3)},
            optional={"required": st.lists(NAME, max_size=3), "additionalProperties": st.one_of(st.booleans(), child)},
        ),
        st.fixed_dictionaries(
            {"type": st.just("array"), "items": child}, optional={"minItems": COUNT, "maxItems": COUNT}
        ),
        st.tuples(st.sampled_from(["anyOf", "allOf", "oneOf"]), st.lists(child, max_size=3)).map(lambda kv: dict([kv])),
        st.fixed_dictionaries({"$defs": st.fixed_dictionaries({"a": child}), "$ref": st.just("#/$defs/a")}),
    )


JSON_SCHEMA = st.recursive(LEAF, _compound, max_leaves=8)
PLAIN = {"model": "run-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@settings(  # each example compiles a new grammar: a few tenths of a second
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(schema=JSON_SCHEMA, as_tool=st.booleans())
@example(schema={"const": "\U00040000"}, as_tool=False)  # a character the vocabulary cannot write (once a 500)
@example(schema={"properties": {"a": {"const": "\ud800"}}}, as_tool=True)  # into the prompt (once a 500, and a hang)
@example(schema={"$ref": "#"}, as_tool=False)  # llguidance validates it; its first mask fails (once a 500)
@example(schema={"type": "array", "items": {"$ref": "#"}, "minItems": 1}, as_tool=True)  # endless forced "[["
def test_no_json_schema_gets_a_5xx_or_kills_the_engine(tiny_server, schema, as_tool):
    """Every schema, as a response_format or as the parameters of a forced tool call, is
    answered 200 or 4xx, and the server answers a plain request after it."""
    body: dict = {**PLAIN, "max_tokens": 4}
    if as_tool:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = "required"
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    r = httpx.post(
        f"{tiny_server.url}/v1/chat/completions",
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code < 500, (schema, r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    assert httpx.post(f"{tiny_server.url}/v1/chat/completions", json=PLAIN, timeout=60).status_code == 200
