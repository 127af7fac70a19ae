"""Answers to /v1/chat/completions and /v1/completions, over any `EngineClient`.

A request becomes one engine request per choice: each prompt (a completions request may send
several, as text or token ids) times `n`. Their events meet in one queue; each choice turns
its tokens into text (`TextStream`: stop strings, half characters), log-probabilities and,
for chat with tools, tool calls. The answer is sent whole when every choice has ended, or
streamed as OpenAI's chunks, one choice `index` per chunk.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kubetune.contracts.engine import AdmissionError, EngineClient, Event, Request, Sampling
from kubetune.serve.http.protocol import error_body
from kubetune.serve.http.text import TextStream
from kubetune.serve.http.tools import ToolCall, ToolCallStream, ToolUse, calls_from_json, parse_tool_calls

LOGPROB_FLOOR = -9999.0  # JSON has no -inf (vLLM sends the same floor)


class EngineFailure(Exception):
    """The engine ended a request with an error: the request's (status 400, naming `param`) or
    the engine's own (500: its sampling, its forward, or the loop)."""

    def __init__(self, message: str, status: int = 500, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


class Refused(Exception):
    """A request the engine would not take (AdmissionError), after its siblings were aborted."""

    def __init__(self, error: AdmissionError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class Prompt:
    ids: list[int]
    text: str  # what `echo` repeats


@dataclass
class Choice:
    """One answer being produced."""

    index: int
    request_id: str
    prompt: Prompt
    text: TextStream
    calls: ToolCallStream | None = None  # chat with tool_choice auto, streamed
    tokens: int = 0
    logprobs: list[tuple[int, float, tuple[tuple[int, float], ...]]] = field(default_factory=list)  # not yet sent
    sent_chars: int = 0  # of the answer's text (completions' text_offset)
    pieces: list[str] = field(default_factory=list)  # the whole text, for an answer sent whole
    finish: str | None = None
    keep_eos: bool = False  # return_tokens_as_token_ids: EOS's log-probability is reported too


@dataclass
class Answer:
    """Everything about one response but the transport."""

    id: str
    model: str
    chat: bool
    choices: list[Choice]
    prompt_tokens: int
    alternatives: int | None  # log-probabilities: None, or the top alternatives per token
    tool_use: ToolUse = field(default_factory=ToolUse)
    echo: bool = False
    created: int = 0
    token_ids: bool = False  # return_tokens_as_token_ids: tokens named "token_id:<id>", as vLLM

    def label(self, tokens: Tokens, token: int) -> str:
        """How a log-probability names its token: its text, or "token_id:<id>"."""
        return f"token_id:{token}" if self.token_ids else tokens.text(token)

    def usage(self) -> dict[str, int]:
        completion = sum(c.tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def body(self, choices: list[dict[str, Any]], chunk: bool, usage: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage:
            out["usage"] = self.usage()
        return out


def submit_all(
    engine: EngineClient,
    answer: Answer,
    samplings: list[Sampling],
    adapter: tuple[int, str | None],
    post: Callable[[int, Event], None],
    constraint: Callable[[], Any] | None,
) -> None:
    """One engine request per choice; if one is refused, the ones already queued are aborted."""
    submitted: list[str] = []
    for choice, sampling in zip(answer.choices, samplings):
        sink = _sink(post, choice.index)
        request = Request(choice.request_id, choice.prompt.ids, sampling, sink, adapter[0], adapter[1])
        request.constraint = constraint() if constraint else None
        try:
            engine.submit(request)
        except AdmissionError as e:
            for rid in submitted:
                engine.abort(rid)
            raise Refused(e) from None
        submitted.append(choice.request_id)


def _sink(post: Callable[[int, Event], None], index: int) -> Callable[[Event], None]:
    return lambda event: post(index, event)


def new_choices(prompts: list[Prompt], n: int, make_text: Callable[[], TextStream], rid: str) -> list[Choice]:
    choices = []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            index = p * n + j
            choices.append(Choice(index, f"{rid}-{index}", prompt, make_text()))
    return choices


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


# --- events to text -------------------------------------------------------------------------
def take(engine: EngineClient, choice: Choice, event: Event) -> str:
    """The text a choice adds with this event (setting `finish` when it ended)."""
    if choice.finish:  # after a stop string: the engine's last tokens and its end
        return ""
    if event.token is None:
        if event.finish_reason == "error":
            raise EngineFailure(event.error or "the engine failed", event.status, event.param)
        choice.finish = event.finish_reason
        return choice.text.flush()
    choice.tokens += 1
    if event.logprob is not None and (event.token != choice.text.eos or choice.keep_eos):
        choice.logprobs.append((event.token, event.logprob, event.top_logprobs))
    delta, stopped = choice.text.push(event.token)
    if stopped:
        choice.finish = "stop"
        engine.abort(choice.request_id, "stop")
    return delta


# --- bodies ------------------------------------------------------------------------------------
class Tokens:
    """Token ids to their text, for log-probabilities (each id decoded once)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self._text = tokenizer, {}  # type: ignore[var-annotated]

    def text(self, token: int) -> str:
        if token not in self._text:
            self._text[token] = str(self.tokenizer.decode([token]))
        return str(self._text[token])


def logprobs_body(answer: Answer, choice: Choice, tokens: Tokens, text: str) -> dict[str, Any] | None:
    """The log-probabilities of the tokens since the last body, in the endpoint's format."""
    if answer.alternatives is None:
        return None
    taken, choice.logprobs = choice.logprobs, []
    if answer.chat:
        return {"content": [_chat_entry(answer, tokens, t, lp, top) for t, lp, top in taken]}
    offsets, at = [], choice.sent_chars
    for token, _, _ in taken:
        offsets.append(at)
        at += len(tokens.text(token))
    choice.sent_chars += len(text)
    return {
        "tokens": [answer.label(tokens, t) for t, _, _ in taken],
        "token_logprobs": [_floor(lp) for _, lp, _ in taken],
        "top_logprobs": [{answer.label(tokens, i): _floor(v) for i, v in top} for _, _, top in taken],
        "text_offset": offsets,
    }


def _chat_entry(
    answer: Answer, tokens: Tokens, token: int, logprob: float, top: tuple[tuple[int, float], ...]
) -> dict[str, Any]:
    def entry(t: int, lp: float) -> dict[str, Any]:
        s = answer.label(tokens, t)
        return {"token": s, "logprob": _floor(lp), "bytes": list(s.encode("utf-8"))}

    return {**entry(token, logprob), "top_logprobs": [entry(i, v) for i, v in top]}


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def whole_choice(answer: Answer, choice: Choice, tokens: Tokens) -> dict[str, Any]:
    """One choice of an answer sent whole."""
    text = "".join(choice.pieces)
    logprobs = logprobs_body(answer, choice, tokens, text)
    finish = choice.finish or "stop"
    if not answer.chat:
        echo = choice.prompt.text if answer.echo else ""
        return {"index": choice.index, "text": echo + text, "logprobs": logprobs, "finish_reason": finish}
    content, calls = _read_calls(answer.tool_use, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.model_dump() for c in calls]
        finish = "tool_calls"
    return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def _read_calls(tool_use: ToolUse, text: str) -> tuple[str | None, list[ToolCall]]:
    if tool_use.parse == "tags":
        return parse_tool_calls(text)
    if tool_use.parse == "json":
        return None, calls_from_json(text)
    return text, []


# --- transports --------------------------------------------------------------------------------
async def _until_all_end(
    answer: Answer, events: asyncio.Queue[tuple[int, Event]]
) -> AsyncIterator[tuple[Choice, Event]]:
    """Each event of a choice still open, until every choice has ended (`take` sets `finish`);
    what the engine still sends for an ended choice (after a stop string) is dropped."""
    open_ = len(answer.choices)
    while open_:
        index, event = await events.get()
        choice = answer.choices[index]
        if choice.finish:
            continue
        yield choice, event
        open_ -= choice.finish is not None


async def collect(
    engine: EngineClient, answer: Answer, events: asyncio.Queue[tuple[int, Event]], tokens: Tokens
) -> dict[str, Any]:
    """The whole answer once every choice has ended."""
    async for choice, event in _until_all_end(answer, events):
        choice.pieces.append(take(engine, choice, event))
    return answer.body([whole_choice(answer, c, tokens) for c in answer.choices], chunk=False, usage=True)


async def stream(
    engine: EngineClient,
    answer: Answer,
    events: asyncio.Queue[tuple[int, Event]],
    tokens: Tokens,
    include_usage: bool,
) -> AsyncIterator[str]:
    """OpenAI's server-sent events; an engine failure ends the stream with an error object."""
    done = False
    try:
        for choice in answer.choices:
            first = _first_chunk(answer, choice)
            if first:
                yield _line(answer.body([first], chunk=True, usage=False))
        async for choice, event in _until_all_end(answer, events):
            try:
                delta = take(engine, choice, event)
            except EngineFailure as e:  # as vLLM streams it: an error object, then the end
                yield _line(error_body(e.status, str(e), e.param))  # (the other choices are aborted below)
                yield "data: [DONE]\n\n"
                return
            for chunk in _chunks(answer, choice, delta, tokens):
                yield _line(answer.body([chunk], chunk=True, usage=False))
        done = True
        if include_usage:
            yield _line(answer.body([], chunk=True, usage=True))
        yield "data: [DONE]\n\n"
    finally:
        if not done:  # the client went away, or one choice failed: free the others' sequences
            for choice in answer.choices:
                if not choice.finish:
                    engine.abort(choice.request_id)


def _line(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _first_chunk(answer: Answer, choice: Choice) -> dict[str, Any] | None:
    """OpenAI's first chat chunk names the role; a completions stream starts with the echo."""
    if answer.chat:
        delta = {"role": "assistant", "content": ""}
        return {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}
    if answer.echo and choice.prompt.text:
        return {"index": choice.index, "text": choice.prompt.text, "logprobs": None, "finish_reason": None}
    return None


def _chunks(answer: Answer, choice: Choice, delta: str, tokens: Tokens) -> list[dict[str, Any]]:
    """The chunks for one event of one choice: its text (if any), then its end (if it ended)."""
    out: list[dict[str, Any]] = []
    if answer.chat:
        content, calls = _stream_calls(answer.tool_use, choice, delta)
    else:
        content, calls = delta, []
    if content or (choice.logprobs and not choice.finish):
        out.append(_delta(answer, choice, content, tokens))
    if choice.finish:
        finish = choice.finish
        if calls:
            out.append(_calls_delta(choice, calls))
            finish = "tool_calls"
        end = _delta(answer, choice, "", tokens) | {"finish_reason": finish}
        if answer.chat:
            end["delta"] = {}
        out.append(end)
    return out


def _delta(answer: Answer, choice: Choice, text: str, tokens: Tokens) -> dict[str, Any]:
    logprobs = logprobs_body(answer, choice, tokens, text)
    if answer.chat:
        return {"index": choice.index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
    return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": None}


def _stream_calls(tool_use: ToolUse, choice: Choice, delta: str) -> tuple[str, list[ToolCall]]:
    """Content to send now, and (at the end) the tool calls, for a streamed chat choice."""
    if tool_use.parse == "none":
        return delta, []
    if tool_use.parse == "json":  # the whole answer is the calls' JSON: nothing is content
        choice.pieces.append(delta)
        return "", calls_from_json("".join(choice.pieces)) if choice.finish else []
    if choice.calls is None:
        choice.calls = ToolCallStream()
    content = choice.calls.feed(delta)
    if not choice.finish:
        return content, []
    rest, calls = choice.calls.finish()
    return content + (rest or ""), calls


def _calls_delta(choice: Choice, calls: list[ToolCall]) -> dict[str, Any]:
    listed = [{"index": i, **call.model_dump()} for i, call in enumerate(calls)]
    return {"index": choice.index, "delta": {"tool_calls": listed}, "logprobs": None, "finish_reason": None}
