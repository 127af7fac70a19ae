"""The OpenAI-compatible HTTP API of `kubetune serve` (FastAPI).

Routes: POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events or
not), GET /v1/models, GET /health (alive), GET /ready (loaded and admitting; 503 before and
while draining), GET /metrics (Prometheus, vLLM's names). Every bad request is a 4xx in
OpenAI's error shape. A client that goes away aborts its sequence at the next decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kubetune.contracts.adapters import split_version
from kubetune.contracts.engine import AdmissionError, Event, Sampling
from kubetune.contracts.serving import HEALTH_PATH, METRICS_PATH, READY_PATH
from kubetune.serve.http.adapter_routes import add_adapter_routes
from kubetune.serve.http.auth import ApiKeyAuth
from kubetune.serve.http.completions import (
    Answer,
    EngineFailure,
    Prompt,
    Refused,
    Tokens,
    collect,
    new_choices,
    new_id,
    stream,
    submit_all,
)
from kubetune.serve.http.protocol import (
    SEED_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from kubetune.serve.http.state import ApiError, Mailbox, ServerState, served_or_503
from kubetune.serve.http.text import TextStream
from kubetune.serve.http.tools import ToolUse, chat_messages, plan_tools

VERSION_HEADER = "x-kubetune-adapter-version"  # the adapter version that answered (NAME@vN), when one did
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer the stream
MAX_CHARS_PER_TOKEN = 32  # a prompt longer than this many characters per allowed token is refused untokenized
# a refused body up to this size is read and dropped, so that its client reads the 413 (BodyLimit)
MAX_DRAIN_BYTES = 256 << 20


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kubetune serve", docs_url=None, redoc_url=None)
    app.state.kubetune = state
    _errors(app)
    app.add_middleware(BodyLimit, limit=state.options.max_body_bytes)
    app.add_middleware(ApiKeyAuth, keys=state.options.api_keys)  # added last = runs first, before any body is read
    add_adapter_routes(app, state)

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
        served = served_or_503(state)
        cards = [_card(state, m) for m in served.models.values()]
        cards += [_alias_card(state, served, name) for name in served.aliases]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> dict[str, Any]:
        served = served_or_503(state)
        if model_id in served.aliases:
            return _alias_card(state, served, model_id)
        return _card(state, _model(served, model_id))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        model = _model(served_or_503(state), body.model)
        tool_use = _checked(lambda: plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls))
        text = _chat_prompt(state, model, body, tool_use)
        prompt = await _tokenized(state, text, "messages", special=not _templated(state, model, body))
        return await _answer(state, request, body, model, [prompt], tool_use)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = _model(served_or_503(state), body.model)
        prompts = [await _completion_prompt(state, p) for p in body.prompts()]
        return await _answer(state, request, body, model, prompts, ToolUse())

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        served = served_or_503(state)
        model = _model(served, body.model or served.base_name, route=False)
        if body.messages is not None:
            as_chat = ChatCompletionRequest(model=model.name, messages=body.messages)
            as_chat.add_generation_prompt = body.add_generation_prompt
            text = _chat_prompt(state, model, as_chat, ToolUse())
            special = not _templated(state, model, as_chat)
        else:
            text, special = body.prompt or "", body.add_special_tokens
        prompt = await _tokenized(state, text, "prompt", special=special, allow_empty=True)
        out: dict[str, Any] = {"count": len(prompt.ids), "max_model_len": state.engine.limits.max_model_len}
        out["tokens"] = prompt.ids
        if body.return_token_strs:
            out["token_strs"] = served.tokenizer.convert_ids_to_tokens(prompt.ids)
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        served = served_or_503(state)
        _model(served, body.model or served.base_name, route=False)
        _check_ids(state, body.tokens, "tokens")
        return {"prompt": served.tokenizer.decode(body.tokens)}

    return app


def _card(state: ServerState, m: Any) -> dict[str, Any]:
    return _named_card(state, m.name, m.parent)


def _named_card(state: ServerState, name: str, parent: str | None) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "kubetune",
        "root": name,
        "parent": parent,
        "max_model_len": state.engine.limits.max_model_len,
    }


def _alias_card(state: ServerState, served: Any, name: str) -> dict[str, Any]:
    """An alias in vLLM's shape of an adapter (parent: the base), with where it routes: `alias_weights`."""
    return _named_card(state, name, served.base_name) | {"alias_weights": dict(served.aliases[name].weights)}


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
        message = str(first.get("msg")).removeprefix("Value error, ")
        named = re.match(r"([A-Za-z_][\w.\[\]]*): ", message)  # a check across fields names its own
        if named:
            where = ".".join(x for x in (where, named.group(1)) if x)
            message = message[named.end() :]
        message = f"{where}: {message}" if where else message
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
    it arrives (pure ASGI: the body is never buffered whole before the check).

    The refused body is read and dropped first (up to MAX_DRAIN_BYTES), then the 413 closes
    the connection: closing on unread bytes makes the kernel reset the connection, and a
    client that writes the whole body before reading the answer (Python's urllib, any client
    that sends `Connection: close`) got a broken pipe instead of the 413. A client waiting for
    `100 Continue` has sent nothing: it gets the 413 at once."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            if int(length) <= MAX_DRAIN_BYTES and headers.get(b"expect", b"").lower() != b"100-continue":
                await _drain(receive)
            return await self._refuse(send)
        seen, over = 0, False

        async def counted() -> Any:
            nonlocal seen, over
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                over = True
                if message.get("more_body"):
                    await _drain(receive)
                raise _TooLarge
            return message

        async def unless_over(message: Any) -> None:
            if not over:  # FastAPI answers a body it could not read with its own 400: the 413 is sent instead
                await send(message)

        with contextlib.suppress(_TooLarge):  # FastAPI may let it through too
            await self.app(scope, counted, unless_over)
        if over:
            await self._refuse(send)

    async def _refuse(self, send: Any) -> None:
        import json

        body = json.dumps(error_body(413, f"the request body is over {self.limit} bytes (--max-body-bytes)")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _drain(receive: Any) -> None:
    """Read and drop the rest of a request body, up to MAX_DRAIN_BYTES."""
    dropped = 0
    while dropped <= MAX_DRAIN_BYTES:
        message = await receive()
        dropped += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body"):
            return


class _TooLarge(Exception):
    pass


def _model(served: Any, name: str, route: bool = True) -> Any:
    """The model that answers a request naming `name`: an alias picks one of its versions, here,
    once for the whole request (`route`; /tokenize and /detokenize read one without counting it)."""
    model = served.resolve(name, route)
    if model is None:
        known = ", ".join([*served.models, *served.aliases])
        raise ApiError(404, f"the model {name!r} does not exist; this server serves: {known}", "model")
    return model


def _checked(make: Any) -> Any:
    """Run a request check that raises ValueError("field: why") as a 400 naming the field."""
    try:
        return make()
    except ValueError as e:
        field_name, _, why = str(e).partition(": ")
        raise ApiError(400, str(e), field_name if why else None) from None


def _templated(state: ServerState, model: Any, body: ChatCompletionRequest) -> bool:
    """Whether the chat goes through a chat template (which writes its own special tokens)."""
    return bool(body.chat_template or state.options.chat_template or model.renderer.uses_chat_template)


def _chat_prompt(state: ServerState, model: Any, body: ChatCompletionRequest, tool_use: ToolUse) -> str:
    """With a chat template (the run's, --chat-template, or the request's where trusted): the
    whole conversation. With a plain template (alpaca, llama2, custom), the last user message
    as the instruction, as `kubetune generate` renders it."""
    if body.chat_template and not state.options.trust_request_chat_template:
        raise ApiError(
            400,
            "chat_template: this server does not take templates from requests "
            "(start it with --trust-request-chat-template, or use --chat-template)",
            "chat_template",
        )
    messages = [m.for_template() for m in body.messages]
    if not _templated(state, model, body):
        if tool_use.offered:
            raise ApiError(
                400,
                f"tools: the model {model.name!r} answers in the {model.renderer.template!r} template, which has no "
                "turns for tools; serve it with --chat-template",
                "tools",
            )
        last = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
        return str(model.renderer.prompt({"instruction": last, "input": ""}))
    template = body.chat_template or state.options.chat_template
    source = template or getattr(model.renderer.tokenizer, "chat_template", None)
    chat = chat_messages(messages, tool_use.offered, source, model.renderer.system_prompt)
    kwargs = {**(body.chat_template_kwargs or {}), **chat.template_kwargs}
    try:
        return str(
            model.renderer.chat_prompt(
                chat.messages,
                chat_template=template,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                **kwargs,
            )
        )
    except Exception as e:  # the template refused the conversation (roles out of order, ...)
        raise ApiError(400, f"messages: the chat template could not render them: {e}", "messages") from None


async def _completion_prompt(state: ServerState, prompt: str | list[int]) -> Prompt:
    if isinstance(prompt, str):
        return await _tokenized(state, prompt, "prompt", special=True)
    _check_ids(state, prompt, "prompt")
    text = await asyncio.to_thread(state.served.tokenizer.decode, prompt)
    return Prompt(list(prompt), str(text))


def _check_ids(state: ServerState, ids: list[int], param: str) -> None:
    vocab = state.engine.vocab_size
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"{param}: the token id {bad} is not in the model's vocabulary (0..{vocab - 1})", param)


async def _tokenized(state: ServerState, text: str, param: str, special: bool, allow_empty: bool = False) -> Prompt:
    limits = state.engine.limits
    if len(text) > limits.max_prompt_tokens * MAX_CHARS_PER_TOKEN:  # refused before the costly part
        raise ApiError(
            400,
            f"the prompt has {len(text)} characters, far over this server's "
            f"{limits.max_prompt_tokens} tokens (--max-prompt-tokens)",
            param,
        )
    # in a worker thread: tokenizing a long prompt must not hold up /health or other requests
    ids = (await asyncio.to_thread(state.served.tokenizer, text, add_special_tokens=special))["input_ids"]
    if not ids and not allow_empty:
        raise ApiError(400, "the prompt is empty; give at least one token of text", param)
    return Prompt(list(ids), text)


def _samplings(state: ServerState, body: Any, prompts: list[Prompt]) -> list[Sampling]:
    """One Sampling per choice (prompt-major, then n), each checked against the limits."""
    limits, engine = state.engine.limits, state.engine
    bias = tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items())
    _check_ids(state, [t for t, _ in bias], "logit_bias")
    _check_ids(state, body.stop_token_ids or [], "stop_token_ids")
    out = []
    for prompt in prompts:
        max_tokens = body.requested_max_tokens() or min(
            state.options.default_max_tokens, limits.max_model_len - len(prompt.ids)
        )
        max_tokens = max(1, max_tokens)
        if body.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens: {body.min_tokens} is more than max_tokens ({max_tokens})", "min_tokens")
        try:
            engine.check(len(prompt.ids), max_tokens)
        except AdmissionError as e:
            raise ApiError(e.status, e.message, e.param) from None
        for j in range(body.n):
            out.append(
                Sampling(
                    max_tokens,
                    body.temperature,
                    body.top_p,
                    None if body.seed is None else (body.seed + j) % (SEED_MAX + 1),  # distinct choices
                    top_k=max(0, body.top_k),
                    min_p=body.min_p,
                    logprobs=body.alternatives,
                    logit_bias=bias,
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    repetition_penalty=body.repetition_penalty,
                    min_tokens=body.min_tokens,
                    ignore_eos=body.ignore_eos,
                    stop_token_ids=tuple(body.stop_token_ids or ()),
                )
            )
    return out


def _constraint(state: ServerState, body: Any, tool_use: ToolUse) -> Any:
    """A factory of per-sequence grammars for the answer's format, or None (free text)."""
    spec = tool_use.grammar or body.response_format
    if tool_use.grammar and body.response_format and body.response_format.type != "text":
        raise ApiError(400, "response_format: not with a forced tool call (tool_choice)", "response_format")
    if spec is None or getattr(spec, "type", None) == "text":
        return None
    if state.grammars is None:
        state.grammars = state.served.grammars(state.engine.eos)
    return _checked(lambda: state.grammars.compile(spec))


async def _answer(
    state: ServerState, request: Request, body: Any, model: Any, prompts: list[Prompt], tool_use: ToolUse
) -> Response:
    served, engine = state.served, state.engine
    chat = isinstance(body, ChatCompletionRequest)
    samplings = _samplings(state, body, prompts)
    constraint = await asyncio.to_thread(_constraint, state, body, tool_use)  # compiling a schema takes a while
    if state.mailbox is None:
        state.mailbox = Mailbox(asyncio.get_running_loop())
        state.tokens = Tokens(served.tokenizer)
    mailbox = state.mailbox
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    rid = new_id(chat)
    choices = new_choices(prompts, body.n, lambda: TextStream(served.tokenizer, body.stops(), engine.eos), rid)
    answer = Answer(rid, model.name, chat, choices, sum(len(p.ids) for p in prompts), body.alternatives, tool_use)
    answer.echo, answer.created = bool(getattr(body, "echo", False)), int(time.time())
    answer.token_ids = body.return_tokens_as_token_ids
    for choice in choices:
        choice.keep_eos = body.return_tokens_as_token_ids
    adapter = (model.adapter, model.name if model.parent else None)
    try:
        submit_all(engine, answer, samplings, adapter, lambda i, ev: mailbox.post(events, (i, ev)), constraint)
    except Refused as e:
        headers = {"Retry-After": "1"} if e.error.status == 429 else None
        raise ApiError(e.error.status, e.error.message, e.error.param, headers) from None
    version = {VERSION_HEADER: model.name} if split_version(model.name) else {}
    if body.stream:
        sse = stream(engine, answer, events, state.tokens, body.include_usage)
        return StreamingResponse(sse, media_type="text/event-stream", headers=SSE_HEADERS | version)
    return JSONResponse(await _whole(engine, request, answer, events, state.tokens), headers=version)


async def _whole(engine: Any, request: Request, answer: Answer, events: Any, tokens: Tokens) -> dict[str, Any]:
    """The answer sent whole; a client that goes away first aborts its sequences."""
    gone = asyncio.ensure_future(_disconnected(request))
    work = asyncio.ensure_future(collect(engine, answer, events, tokens))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            _abort_open(engine, answer)
            raise ApiError(499, "client disconnected")
        try:
            return work.result()
        except EngineFailure as e:  # one choice failed: the others are not waited for
            _abort_open(engine, answer)
            raise ApiError(e.status, str(e), e.param) from None
    finally:
        gone.cancel()


def _abort_open(engine: Any, answer: Answer) -> None:
    for choice in answer.choices:
        if not choice.finish:
            engine.abort(choice.request_id)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
