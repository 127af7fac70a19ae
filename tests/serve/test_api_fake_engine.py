"""The HTTP layer against a scripted engine: everything api.py and completions.py decide
(stop strings, choices, tool-call parsing, refusals, failures) without a model, through the
EngineClient interface alone. `tokenizer` is the session's real SmolLM2 tokenizer (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kubetune.contracts.engine import AdmissionError, Event, Limits, Request
from kubetune.data.templates import PromptRenderer
from kubetune.serve.http.api import create_app
from kubetune.serve.http.state import ServerState
from kubetune.serve.native.models import Served, ServedSet

pytestmark = pytest.mark.process

ANSWER = "The answer is 42."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


class ScriptedEngine:
    """Answers every request with the tokens of `script`, then EOS (or fails after `fail_after`)."""

    def __init__(
        self, tokenizer, script: str = ANSWER, fail_after: int | None = None, room: int = 100, only_first: bool = False
    ) -> None:
        self.limits = Limits(max_num_seqs=4)
        self.eos, self.vocab_size = tokenizer.eos_token_id, len(tokenizer)
        self.error = None
        self.tokens = tokenizer(script, add_special_tokens=False)["input_ids"]
        self.fail_after, self.room, self.only_first = fail_after, room, only_first
        self.submitted: list[Request] = []
        self.aborted: list[tuple[str, str]] = []

    @property
    def in_flight(self) -> int:
        return 0

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.limits.max_model_len:
            raise AdmissionError(400, "too long", "max_tokens")

    def submit(self, request: Request) -> None:
        if len(self.submitted) >= self.room:
            raise AdmissionError(429, "the queue is full")
        self.submitted.append(request)
        threading.Thread(target=self._answer, args=(request,), daemon=True).start()

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self.aborted.append((request_id, reason))

    def _answer(self, request: Request) -> None:
        failing = not self.only_first or request is self.submitted[0]
        for i, token in enumerate(self.tokens[: request.sampling.max_tokens]):
            if not failing:
                time.sleep(0.05)  # the sibling is still running when the first one fails
                if any(rid == request.id for rid, _ in self.aborted):
                    return
            if failing and i == self.fail_after:
                request.sink(Event(None, "error", "the forward pass failed: boom"))
                return
            request.sink(Event(token, logprob=-0.5 if request.sampling.logprobs is not None else None))
        request.sink(Event(self.eos))
        request.sink(Event(None, "stop"))


def _ask(tokenizer, path: str, body: dict, **engine_kw) -> tuple[httpx.Response, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer, **engine_kw)
    served = ServedSet(None, tokenizer, "m")  # no model: the fake engine answers
    served.models = {"m": Served("m", PromptRenderer("chat", tokenizer))}
    state = ServerState(served=served, engine=engine)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            return await c.post(path, json={"model": "m", **body})

    return asyncio.run(go()), engine


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}


def _events(r: httpx.Response) -> list:
    lines = [ln.removeprefix("data: ") for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_a_stop_string_across_tokens_ends_the_answer_and_the_sequence(tokenizer):
    r, engine = _ask(tokenizer, "/v1/chat/completions", {**CHAT, "stop": ["is 4"]})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "The answer " and choice["finish_reason"] == "stop"
    assert [reason for _, reason in engine.aborted] == ["stop"]


def test_n_choices_are_separate_engine_requests_with_their_own_seeds(tokenizer):
    r, engine = _ask(tokenizer, "/v1/completions", {"prompt": "x", "n": 3, "seed": 5, "max_tokens": 50})
    body = r.json()
    assert [c["text"] for c in body["choices"]] == [ANSWER] * 3
    assert [req.sampling.seed for req in engine.submitted] == [5, 6, 7]
    assert body["usage"]["completion_tokens"] == 3 * (len(engine.tokens) + 1)  # EOS counts, as vLLM counts it


def test_a_refused_choice_aborts_the_ones_already_queued(tokenizer):
    r, engine = _ask(tokenizer, "/v1/completions", {"prompt": "x", "n": 3}, room=2)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert sorted(rid for rid, _ in engine.aborted) == sorted(req.id for req in engine.submitted)


def test_an_engine_failure_is_a_json_500_or_an_error_event(tokenizer):
    whole, _ = _ask(tokenizer, "/v1/chat/completions", CHAT, fail_after=2)
    assert whole.status_code == 500 and "boom" in whole.json()["error"]["message"]
    streamed, _ = _ask(tokenizer, "/v1/chat/completions", {**CHAT, "stream": True}, fail_after=2)
    events = _events(streamed)
    assert "boom" in events[-1]["error"]["message"]
    assert all(c.get("finish_reason") != "error" for e in events for c in e.get("choices", []))


@pytest.mark.parametrize("stream", [False, True])
def test_when_one_choice_fails_its_siblings_are_aborted(tokenizer, stream):
    body = {"prompt": "x", "n": 2, "max_tokens": 50, "stream": stream}
    r, engine = _ask(tokenizer, "/v1/completions", body, fail_after=1, only_first=True)
    assert (r.status_code == 500) if not stream else ("boom" in _events(r)[-1]["error"]["message"])
    assert engine.submitted[1].id in [rid for rid, _ in engine.aborted]


TOOLS = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}


def test_auto_tool_calls_are_parsed_whole_and_streamed(tokenizer):
    r, _ = _ask(tokenizer, "/v1/chat/completions", {**CHAT, **TOOLS}, script="Let me look. " + CALL)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    streamed, _ = _ask(tokenizer, "/v1/chat/completions", {**CHAT, **TOOLS, "stream": True}, script=CALL)
    deltas = [c["delta"] for e in _events(streamed) for c in e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == ""  # the call is never sent as text
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert [tc["function"]["name"] for tc in calls] == ["get_weather"] and calls[0]["index"] == 0
    assert _events(streamed)[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_logprobs_follow_the_tokens_sent(tokenizer):
    r, _ = _ask(tokenizer, "/v1/chat/completions", {**CHAT, "logprobs": True})
    entries = r.json()["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == ANSWER and all(e["logprob"] == -0.5 for e in entries)


def test_the_http_layer_imports_no_torch():
    code = "import sys, kubetune.serve.http.api, kubetune.serve.http.completions; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
