"""The OpenAI-compatible HTTP API of `kubetune serve` (FastAPI).

Routes: POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events or
not), GET /v1/models, GET /health (alive), GET /ready (loaded and admitting; 503 before and
while draining), GET /metrics (Prometheus, vLLM's names). Every bad request is a 4xx in
OpenAI's error shape. A client that goes away aborts its sequence at the next decode step.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kubetune.serve.auth import ApiKeyAuth
from kubetune.serve.contract import HEALTH_PATH, METRICS_PATH, READY_PATH
from kubetune.serve.engine_client import AdmissionError, Event, Sampling
from kubetune.serve.engine_client import Request as EngineRequest
from kubetune.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body
from kubetune.serve.text import TextStream

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer the stream
MAX_CHARS_PER_TOKEN = 32  # a prompt longer than this many characters per allowed token is refused untokenized
DEFAULT_MAX_BODY_BYTES = 2 << 20  # --max-body-bytes: a request body larger than this is a 413


class EngineFailure(Exception):
    """The engine ended a request with an error (its sampling, its forward, or the loop)."""


class Mailbox:
    """Engine events to the requests' queues on the event loop, with at most one wake-up of the
    loop per engine step (instead of one per token of every running sequence)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[asyncio.Queue[Event], Event]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue[Event], event: Event) -> None:
        with self._lock:
            self._items.append((queue, event))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, event in items:
            queue.put_nowait(event)


@dataclass
class ServerState:
    """What the routes need; `served` and `engine` are None until the model has loaded."""

    default_max_tokens: int = 512
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_keys: tuple[str, ...] = ()  # none: every route is open (kubetune.serve.auth)
    served: Any = None
    engine: Any = None
    metrics: Any = None
    draining: bool = False
    mailbox: Mailbox | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def failed(self) -> str | None:
        """Why the engine can no longer answer (its loop died), None while it can."""
        error = getattr(self.engine, "error", None)
        return None if error is None else f"the engine failed ({error!r}); the server must be restarted"

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining and self.failed is None


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kubetune serve", docs_url=None, redoc_url=None)
    app.state.kubetune = state
    _errors(app)
    app.add_middleware(BodyLimit, limit=state.max_body_bytes)
    app.add_middleware(ApiKeyAuth, keys=state.api_keys)  # added last = runs first, before any body is read

    @app.get(HEALTH_PATH)
    async def health() -> JSONResponse:
        if state.failed:  # the liveness probe restarts the pod
            return JSONResponse({"status": state.failed}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get(READY_PATH)
    async def ready() -> JSONResponse:
        if state.ready:
            return JSONResponse({"status": "ready"})
        why = state.failed or ("draining" if state.draining else "loading")
        return JSONResponse({"status": why}, status_code=503)

    @app.get(METRICS_PATH)
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(state.metrics.registry) if state.metrics else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        served = _served(state)
        limit = state.engine.limits.max_model_len
        data = [
            {
                "id": m.name,
                "object": "model",
                "created": state.created,
                "owned_by": "kubetune",
                "root": m.name,
                "parent": m.parent,
                "max_model_len": limit,
            }
            for m in served.models.values()
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        served = _served(state)
        model = _model(served, body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        prompt = _chat_prompt(model.renderer, messages)
        return await _complete(state, request, body, model, prompt, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        served = _served(state)
        model = _model(served, body.model)
        text = body.prompt_text()
        if text is None:
            raise ApiError(400, "give one prompt per request (a string, or a list of one)", "prompt")
        return await _complete(state, request, body, model, text, chat=False)

    return app


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(400, f"the body is not valid JSON: {first.get('msg')}"), status_code=400)
        where = ".".join(str(p) for p in first.get("loc", ()) if _is_field(p))
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        return JSONResponse(error_body(400, message, where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def bug(_: Request, e: Exception) -> JSONResponse:  # never a plain-text 500
        return JSONResponse(error_body(500, f"internal error: {e!r}"), status_code=500)


def _is_field(part: Any) -> bool:
    """A path element of the request body, not pydantic's name of a union branch or validator."""
    return isinstance(part, int) or (part != "body" and str(part).isidentifier() and part not in _TYPE_NAMES)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict"}


class BodyLimit:
    """413 for a request body over `limit` bytes, by its Content-Length or, when chunked, as
    it arrives (pure ASGI: the body is never buffered whole before the check)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(send)
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send: Any) -> None:
        import json

        body = json.dumps(error_body(413, f"the request body is over {self.limit} bytes (--max-body-bytes)")).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def _served(state: ServerState) -> Any:
    if state.failed:
        raise ApiError(503, state.failed)
    if not state.ready:
        raise ApiError(
            503,
            "the server is draining" if state.draining else "the model is still loading; retry shortly",
            headers={"Retry-After": "1"},
        )
    return state.served


def _model(served: Any, name: str) -> Any:
    model = served.models.get(name)
    if model is None:
        known = ", ".join(served.models)
        raise ApiError(404, f"the model {name!r} does not exist; this server serves: {known}", "model")
    return model


def _chat_prompt(renderer: Any, messages: list[dict[str, str]]) -> str:
    """With a chat template: the whole conversation. With a plain template (alpaca, llama2,
    custom), the last user message as the instruction, as `kubetune generate` renders it."""
    if renderer.uses_chat_template:
        return str(renderer._chat_prompt(messages))
    last = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
    return str(renderer.prompt({"instruction": last, "input": ""}))


async def _complete(state: ServerState, request: Request, body: Any, model: Any, prompt: str, chat: bool) -> Response:
    served, engine = state.served, state.engine
    param = "messages" if chat else "prompt"
    if len(prompt) > engine.limits.max_prompt_tokens * MAX_CHARS_PER_TOKEN:  # refused before the costly part
        raise ApiError(
            400,
            f"the prompt has {len(prompt)} characters, far over this server's "
            f"{engine.limits.max_prompt_tokens} tokens (--max-prompt-tokens)",
            param,
        )
    special = not (chat and model.renderer.uses_chat_template)
    # in a worker thread: tokenizing a long prompt must not hold up /health or other requests
    ids = (await asyncio.to_thread(served.tokenizer, prompt, add_special_tokens=special))["input_ids"]
    if not ids:
        raise ApiError(400, "the prompt is empty; give at least one token of text", param)
    max_tokens = body.requested_max_tokens() or min(state.default_max_tokens, engine.limits.max_model_len - len(ids))
    sampling = Sampling(max(1, max_tokens), body.temperature, body.top_p, body.seed)
    if state.mailbox is None:
        state.mailbox = Mailbox(asyncio.get_running_loop())
    mailbox = state.mailbox
    events: asyncio.Queue[Event] = asyncio.Queue()
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    req = EngineRequest(
        rid,
        ids,
        sampling,
        lambda ev: mailbox.post(events, ev),
        model.adapter,
        model.name if model.parent else None,
    )
    try:
        engine.submit(req)
    except AdmissionError as e:
        headers = {"Retry-After": "1"} if e.status == 429 else None
        raise ApiError(e.status, e.message, e.param, headers) from None
    text = TextStream(served.tokenizer, body.stops(), engine.eos)
    reply = _Reply(rid, model.name, chat, len(ids))
    if body.stream:
        return StreamingResponse(
            _sse(engine, events, text, reply, body.include_usage), media_type="text/event-stream", headers=SSE_HEADERS
        )
    return JSONResponse(await _collect(engine, request, events, text, reply))


@dataclass
class _Reply:
    id: str
    model: str
    chat: bool
    prompt_tokens: int
    completion_tokens: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def message(self, text: str, finish: str) -> dict[str, Any]:
        """The one choice of a whole (not streamed) answer."""
        if self.chat:
            return {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def body(self, choices: list[dict[str, Any]], chunk: bool, usage: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage:
            out["usage"] = self.usage()
        return out


async def _next_piece(
    engine: Any, events: asyncio.Queue[Event], text: TextStream, reply: _Reply
) -> tuple[str, str | None]:
    """(new text, finish reason or None) after the next engine event."""
    ev = await events.get()
    if ev.token is not None:
        reply.completion_tokens += 1
        delta, stopped = text.push(ev.token)
        if stopped:
            engine.abort(reply.id, "stop")
            await _drain_until_end(events)
            return delta, "stop"
        return delta, None
    if ev.finish_reason == "error":
        raise EngineFailure(ev.error or "the engine failed")
    return text.flush(), ev.finish_reason


async def _drain_until_end(events: asyncio.Queue[Event]) -> None:
    while (await events.get()).finish_reason is None:
        pass


async def _collect(
    engine: Any, request: Request, events: asyncio.Queue[Event], text: TextStream, reply: _Reply
) -> dict[str, Any]:
    gone = asyncio.ensure_future(_disconnected(request))
    pieces: list[str] = []
    try:
        while True:
            piece = asyncio.ensure_future(_next_piece(engine, events, text, reply))
            await asyncio.wait({piece, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not piece.done():
                piece.cancel()
                engine.abort(reply.id)
                raise ApiError(499, "client disconnected")
            try:
                delta, finish = piece.result()
            except EngineFailure as e:
                raise ApiError(500, str(e)) from None
            pieces.append(delta)
            if finish:
                return reply.body([reply.message("".join(pieces), finish)], chunk=False, usage=True)
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(
    engine: Any, events: asyncio.Queue[Event], text: TextStream, reply: _Reply, include_usage: bool
) -> AsyncIterator[str]:
    import json

    def line(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    finished = False
    try:
        if reply.chat:  # OpenAI's first chunk names the role
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield line(reply.body([first], chunk=True, usage=False))
        while True:
            try:
                delta, finish = await _next_piece(engine, events, text, reply)
            except EngineFailure as e:  # as vLLM streams it: an error object, then the end
                finished = True
                yield line(error_body(500, str(e)))
                yield "data: [DONE]\n\n"
                return
            if delta:
                yield line(reply.body([_delta(reply, delta)], chunk=True, usage=False))
            if finish:
                finished = True
                yield line(reply.body([_end(reply, finish)], chunk=True, usage=False))
                if include_usage:
                    yield line(reply.body([], chunk=True, usage=True))
                yield "data: [DONE]\n\n"
                return
    finally:
        if not finished:  # the client went away (the response was cancelled): free its sequence
            engine.abort(reply.id)


def _delta(reply: _Reply, text: str) -> dict[str, Any]:
    if reply.chat:
        return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}


def _end(reply: _Reply, finish: str) -> dict[str, Any]:
    if reply.chat:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
