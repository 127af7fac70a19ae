"""vLLM's OpenAI parameters against a real `kubetune serve` process: each one changes the answer
the way its definition says (or is refused by name), with the official client where it has them."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from .conftest import ServerProcess

pytestmark = pytest.mark.process

USER = [{"role": "user", "content": "Say something"}]


@pytest.fixture(scope="module")
def server(tiny_runs):
    a, b = tiny_runs
    args = [str(a), "--adapter", f"qv={b}", "--dtype", "fp32", "--served-model-name", "tiny"]
    server = ServerProcess([*args, "--served-model-name", "tiny-alias", "--trust-request-chat-template"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _tokens(server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _greedy(client, **kw):
    return client.completions.create(model="tiny", prompt="1 2 3", max_tokens=6, temperature=0, **kw)


def test_served_model_names_and_one_model_card(client, server):
    listed = {m.id: getattr(m, "parent", None) for m in client.models.list().data}
    assert listed["tiny"] is None and listed["tiny-alias"] is None
    assert listed["qv"] == "tiny" and listed["run-a"] == "tiny"
    assert client.models.retrieve("qv").id == "qv"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    same = [
        _greedy(client).choices[0].text,
        client.completions.create(model="tiny-alias", prompt="1 2 3", max_tokens=6, temperature=0).choices[0].text,
    ]
    assert same[0] == same[1]


def test_n_choices_and_lists_of_prompts_and_token_ids(client, server):
    r = client.chat.completions.create(model="tiny", messages=USER, n=3, max_tokens=8, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # seeds seed, seed+1, seed+2: distinct samples
    again = client.chat.completions.create(model="tiny", messages=USER, n=3, max_tokens=8, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    ids = _tokens(server, "1 2 3")
    other = _tokens(server, "4 5 6")
    several = client.completions.create(model="tiny", prompt=[ids, other], n=2, max_tokens=6, temperature=0)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[0].text == several.choices[1].text == _greedy(client).choices[0].text
    assert several.usage.prompt_tokens == len(ids) + len(other)
    texts = client.completions.create(model="tiny", prompt=["1 2 3", "4 5 6"], max_tokens=6, temperature=0)
    assert [c.text for c in texts.choices] == [several.choices[0].text, several.choices[2].text]
    assert several.usage.completion_tokens == 4 * 6


def test_logprobs_in_both_formats(client):
    chat = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 5 and "".join(e.token for e in entries) == chat.choices[0].message.content
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy: the likeliest
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.logprob <= 0
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    text = _greedy(client, logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    lp = text.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == text.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_tokens_as_token_ids_are_the_ids_sampled_eos_included(client, server, tokenizer):
    """vLLM's return_tokens_as_token_ids, as GRPO's rollout=server reads it: the same answer as
    without it, its tokens named "token_id:<id>", and an ending EOS kept with its log-probability."""

    def sample(**extra):
        kw = {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 1.0, "seed": 11, "logprobs": 0}
        return client.completions.create(model="qv", **kw, extra_body=extra).choices[0]

    as_text, as_ids = sample(ignore_eos=True), sample(ignore_eos=True, return_tokens_as_token_ids=True)
    ids = [int(t.removeprefix("token_id:")) for t in as_ids.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in as_ids.logprobs.tokens) and len(ids) == 8
    assert as_ids.logprobs.token_logprobs == as_text.logprobs.token_logprobs and as_ids.text == as_text.text
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert detok == as_text.text
    eos = tokenizer.eos_token_id
    forced = {"logit_bias": {str(eos): 100}}  # the first token is EOS: the answer ends on it
    plain, with_ids = sample(**forced), sample(**forced, return_tokens_as_token_ids=True)
    assert plain.finish_reason == with_ids.finish_reason == "stop"
    assert plain.logprobs.tokens == [] and with_ids.logprobs.tokens == [f"token_id:{eos}"]
    assert with_ids.logprobs.token_logprobs[0] <= 0


def test_echo_logit_bias_and_penalties(client, server):
    assert (
        client.completions.create(model="tiny", prompt="1 2 3", max_tokens=2, echo=True)
        .choices[0]
        .text.startswith("1 2 3")
    )
    first = _tokens(server, _greedy(client).choices[0].text)[0]
    banned = _greedy(client, logit_bias={str(first): -100}).choices[0].text
    assert _tokens(server, banned)[:1] != [first]
    forced = client.completions.create(
        model="tiny",
        prompt="1 2 3",
        max_tokens=6,
        temperature=0,
        logit_bias={str(first): 100},
        extra_body={"ignore_eos": True},
        logprobs=0,
    ).choices[0]
    assert forced.text == forced.logprobs.tokens[0] * 6
    # +5 makes one token win every step; a frequency penalty of 2 per use takes it back after a few
    repeat = {"logit_bias": {str(first): 5}, "extra_body": {"ignore_eos": True}, "logprobs": 0}
    plain = _greedy(client, **repeat).choices[0].logprobs.tokens
    penalised = _greedy(client, frequency_penalty=2.0, presence_penalty=2.0, **repeat).choices[0].logprobs.tokens
    assert plain.count(plain[0]) == 6 and penalised.count(plain[0]) < 6


def test_min_tokens_ignore_eos_and_stop_token_ids(client, server):
    eos = httpx.post(f"{server.url}/tokenize", json={"prompt": "", "add_special_tokens": False}, timeout=10)
    assert eos.status_code == 200 and eos.json()["count"] == 0
    eos_id = _eos_id(server)
    ends_now = _greedy(client, logit_bias={str(eos_id): 100})
    assert ends_now.choices[0].finish_reason == "stop" and ends_now.usage.completion_tokens == 1
    later = _greedy(client, logit_bias={str(eos_id): 100}, extra_body={"min_tokens": 3})
    assert later.usage.completion_tokens == 4 and later.choices[0].finish_reason == "stop"
    never = _greedy(client, logit_bias={str(eos_id): 100}, extra_body={"ignore_eos": True})
    assert never.usage.completion_tokens == 6 and never.choices[0].finish_reason == "length"
    tokens = _greedy(client, logprobs=0, extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
    third = _tokens(server, tokens[2])[0]
    stopped = _greedy(client, extra_body={"stop_token_ids": [third], "ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 3


def _eos_id(server) -> int:
    card = httpx.get(f"{server.url}/v1/models/tiny", timeout=10).json()
    assert card["id"] == "tiny"
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "<|im_end|>", "add_special_tokens": False}, timeout=10)
    ids = r.json()["tokens"]
    assert len(ids) == 1, "the tiny tokenizer's EOS is <|im_end|>"
    return ids[0]


def test_tokenize_detokenize_round_trip(server):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world", "return_token_strs": True}, timeout=10)
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] > 0
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]}, timeout=10).json()
    assert back["prompt"].endswith("hello world")
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": USER}, timeout=10).json()
    assert chat["count"] > body["count"]
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("key", ["messages", "tokenize", "tools"])
def test_template_variables_cannot_replace_the_requests_own_arguments(server, key):
    body = {"model": "tiny", "messages": USER, "max_tokens": 2, "chat_template_kwargs": {key: True}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    assert key in r.json()["error"]["message"]


def test_a_request_chat_template_is_used_where_trusted(client, server):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=1, extra_body={"chat_template": template}
    )
    assert r.usage.prompt_tokens == len(_tokens(server, "Say something"))


class Verdict(BaseModel):
    label: Literal["yes", "no", "maybe"]
    confident: bool


def test_parse_returns_a_schema_valid_object(client):
    for model in ("tiny", "qv"):
        r = client.chat.completions.parse(
            model=model, messages=USER, response_format=Verdict, max_tokens=40, temperature=1.0, seed=3
        )
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Verdict)


def test_a_schema_the_grammar_cannot_take_is_a_400_naming_it(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, response_format=bad, max_tokens=5)
    assert str(e.value.body.get("param", "")).startswith("response_format")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_round_trip(client, server, stream):
    ask = {"model": "tiny", "messages": USER, "tools": [WEATHER], "max_tokens": 40, "temperature": 0}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        calls, finish = [], None
        for chunk in client.chat.completions.create(**ask, tool_choice=choice, stream=True):
            delta = chunk.choices[0].delta
            calls += delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    else:
        r = client.chat.completions.create(**ask, tool_choice=choice)
        calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert finish == "tool_calls" and len(calls) == 1
    call = calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude={"index"}, exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    follow = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=4)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": history, "return_token_strs": True}, timeout=10)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": prompt.json()["tokens"]}, timeout=10).json()
    assert "sunny, 21 C" in text["prompt"] and "get_weather" in text["prompt"]


def test_required_tool_choice_gives_a_call(client):
    """(With parallel calls the random tiny model would go on adding calls to max_tokens.)"""
    r = client.chat.completions.create(
        model="tiny",
        messages=USER,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1


def test_streamed_choices_equal_whole_ones(client):
    ask = {"model": "tiny", "prompt": "1 2 3", "max_tokens": 6, "temperature": 0, "n": 2, "logprobs": 1}
    whole = client.completions.create(**ask)
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.completions.create(**ask, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            tokens[c.index] += c.logprobs.tokens if c.logprobs else []
    assert texts == {c.index: c.text for c in whole.choices}
    assert tokens[0] == whole.choices[0].logprobs.tokens


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"min_tokens": 50, "max_tokens": 5}, "min_tokens"),
        ({"prompt": [[1, 2], [10**9]]}, "prompt"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ],
)
def test_what_is_not_served_is_refused_by_name(server, extra, param):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 5, **extra}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert str(r.json()["error"]["param"]).startswith(param), r.json()
