"""`kubetune serve` as a real process on loopback, spoken to with the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import httpx
import openai
import pytest

from kubetune.contracts.engine import Limits
from kubetune.serve.http.api import create_app
from kubetune.serve.http.state import ServerState
from tests.kit.cli import run_cli_in_process, run_cli_subprocess

from .conftest import ServerProcess, metric

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_list_the_base_and_every_adapter_with_its_parent(client, tiny_model_dir):
    """The base under its recipe name, the run's adapter under the run directory's name, and
    each --adapter under its own name."""
    parents = {m.id: getattr(m, "parent", None) for m in client.models.list().data}
    base = tiny_model_dir.name
    assert parents == {base: None, "run-a": base, "qv": base}


def test_chat_plain_and_streamed_give_the_same_answer_and_usage(client):
    ask = {
        "model": "run-a",
        "messages": [{"role": "user", "content": "What is 2 plus 2?"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed
    assert whole.choices[0].finish_reason in ("length", "stop")
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.completion_tokens == whole.usage.completion_tokens <= 12
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant"


def test_each_model_answers_in_its_own_way(client):
    answers = {}
    for model in ("run-a", "qv", _base(client)):
        answer = client.completions.create(
            model=model, prompt="Answer truthfully: 3 plus 3 is", max_tokens=10, temperature=0
        )
        assert answer.object == "text_completion" and answer.usage.completion_tokens >= 1
        answers[model] = answer.choices[0].text
    assert len(set(answers.values())) > 1, answers


def test_completions_stream_and_stop_string(client):
    base = _base(client)
    whole = client.completions.create(model=base, prompt="1 2 3", max_tokens=16, temperature=0)
    text = whole.choices[0].text
    assert text
    cut = text[len(text) // 2 :][:3].strip() or text[-1]
    stopped = client.completions.create(model=base, prompt="1 2 3", max_tokens=16, temperature=0, stop=[cut])
    assert stopped.choices[0].finish_reason == "stop"
    assert cut not in stopped.choices[0].text and text.startswith(stopped.choices[0].text)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=base, prompt="1 2 3", max_tokens=16, temperature=0, stream=True)
    )
    assert streamed == text


CONTINUE = "continue_final_message"
SCHEMA = "response_format.json_schema.schema"
ENDLESS_ARRAY = {"type": "array", "items": {"$ref": "#"}, "minItems": 1}  # [[[[...: its forced tokens never end
VLLM_EXTRAS = {"chat_template", "continue_final_message", "add_generation_prompt"}  # openai sends them in extra_body


def _json_schema(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"model": "nope"}, openai.NotFoundError, "model"),
        ({"n": 17}, openai.BadRequestError, "n"),
        ({"top_logprobs": 3}, openai.BadRequestError, "top_logprobs"),
        ({"logit_bias": {"999999": 5}}, openai.BadRequestError, "logit_bias"),
        ({"chat_template": "{{ 1 }}"}, openai.BadRequestError, "chat_template"),
        ({"max_tokens": 100_000}, openai.BadRequestError, "max_tokens"),
        ({"temperature": 5}, openai.BadRequestError, "temperature"),
        ({"messages": []}, openai.BadRequestError, "messages"),
        # vLLM's own extras: the conversation must end in the assistant message to continue
        ({"continue_final_message": True, "add_generation_prompt": False}, openai.BadRequestError, CONTINUE),
        ({"continue_final_message": True}, openai.BadRequestError, CONTINUE),  # add_generation_prompt: true
        # a schema llguidance validates but cannot start (a recursion with no way out): once a 500
        ({"response_format": _json_schema({"$ref": "#"})}, openai.BadRequestError, SCHEMA),
        ({"response_format": _json_schema(ENDLESS_ARRAY)}, openai.BadRequestError, SCHEMA),
    ],
)
def test_bad_requests_get_openai_errors(client, kwargs, error, param):
    ask = {"model": "run-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(error) as e:
        known = {k: v for k, v in ask.items() if k not in VLLM_EXTRAS}
        client.chat.completions.create(**known, extra_body={k: v for k, v in ask.items() if k not in known})
    body = e.value.body
    assert isinstance(body, dict) and body.get("param") == param and body.get("message")
    assert client.chat.completions.create(
        model="run-a", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    ).choices


def test_continue_final_message_refusals_say_what_vllm_says(client):
    """vLLM refuses both flags with "Cannot set both `continue_final_message` and
    `add_generation_prompt` to True." (its protocol.py); kubetune says the same, and that
    add_generation_prompt is true unless sent as false. Continuing needs an assistant turn."""
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as both:
        client.chat.completions.create(model="run-a", messages=user, extra_body={"continue_final_message": True})
    assert "cannot set both `continue_final_message` and `add_generation_prompt`" in both.value.body["message"]
    with pytest.raises(openai.BadRequestError) as after_user:
        extra = {"continue_final_message": True, "add_generation_prompt": False}
        client.chat.completions.create(model="run-a", messages=user, extra_body=extra)
    assert "the last message is a 'user' message" in after_user.value.body["message"]
    prefill = [*user, {"role": "assistant", "content": "The answer is"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    answer = client.chat.completions.create(model="run-a", messages=prefill, max_tokens=3, extra_body=extra)
    assert answer.choices[0].message.role == "assistant"


def test_a_json_schema_llguidance_cannot_start_is_a_400_with_its_reason(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="run-a",
            messages=[{"role": "user", "content": "hi"}],
            response_format=_json_schema({"$ref": "#"}),  # type: ignore[arg-type]
        )
    message = e.value.body["message"]
    assert message.startswith(f"{SCHEMA}: this JSON schema cannot be used for constrained decoding (")
    assert "NoExtensionBias" in message  # llguidance's own reason


def test_malformed_json_is_400_not_500(tiny_server):
    r = httpx.post(
        f"{tiny_server.url}/v1/chat/completions",
        content=b"{not json",
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_metrics_count_what_was_served(tiny_server, client):
    before = tiny_server.metrics()
    usages = []
    for model in ("run-a", "qv"):
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count to three"}], max_tokens=5, temperature=0
        )
        usages.append(r.usage)
    after = tiny_server.metrics()

    def grew(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert grew("vllm:request_success_total") == 2
    assert grew("vllm:time_to_first_token_seconds_count") == 2
    assert grew("vllm:e2e_request_latency_seconds_count") == 2
    assert metric(after, "vllm:num_requests_running") == 0
    names = {n for n, _ in after}
    for required in (
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:lora_requests_info",
    ):
        assert required in names
    labels = {dict(ls).get("model_name") for n, ls in after if n == "vllm:generation_tokens_total"}
    assert labels == {_base(client)}


def test_a_client_that_disconnects_frees_its_sequence(tiny_server):
    before = metric(tiny_server.metrics(), "vllm:request_success_total", finished_reason="abort")
    body = {"model": "run-a", "prompt": "x", "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        values = tiny_server.metrics()
        if metric(values, "vllm:request_success_total", finished_reason="abort") > before:
            break
        time.sleep(0.05)
    assert metric(values, "vllm:request_success_total", finished_reason="abort") == before + 1
    assert metric(values, "vllm:num_requests_running") == 0
    assert metric(values, "vllm:generation_tokens_total") < 1000


def test_ready_is_503_until_loaded_and_while_draining():
    async def check():
        state = ServerState()
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/ready")).status_code == 503
            r = await c.post(
                "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            )
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            state.engine, state.draining = object(), True
            assert (await c.get("/ready")).json() == {"status": "draining"}

    asyncio.run(check())


def test_a_full_queue_gets_429_with_retry_after(tiny_runs):
    server = ServerProcess([str(tiny_runs[0]), "--dtype", "fp32", "--max-num-seqs", "1", "--max-waiting", "1"])
    try:
        statuses, headers = [], []

        def ask():
            r = httpx.post(
                f"{server.url}/v1/completions",
                timeout=120,
                json={"model": "run-a", "prompt": "x", "max_tokens": 400, "temperature": 0},
            )
            statuses.append(r.status_code)
            headers.append(r.headers.get("retry-after"))

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.1)
        for t in threads:
            t.join()
    finally:
        server.stop()
    assert sorted(statuses).count(200) >= 2 and 429 in statuses
    assert all(h == "1" for s, h in zip(statuses, headers) if s == 429)


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_runs):
    server = ServerProcess([str(tiny_runs[0]), "--dtype", "fp32", "--drain-seconds", "60"])
    finish: list[str] = []
    body = {"model": "run-a", "prompt": "x", "max_tokens": 300, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert httpx.get(f"{server.url}/ready", timeout=5).status_code == 503
        late = httpx.post(f"{server.url}/v1/completions", timeout=5, json={"model": "run-a", "prompt": "y"})
        assert late.status_code == 503
        for line in lines:
            if '"finish_reason": "' in line:
                finish.append(line.split('"finish_reason": "')[1].split('"')[0])
    assert finish == ["length"]
    assert server.proc.wait(timeout=30) == 0
    assert "draining" in server.stop()


def test_bad_targets_and_options_are_one_line(tmp_path, capfd):
    """The first as a real process, the others through kubetune.cli.main in this process."""
    for i, (args, words) in enumerate(
        (
            (["serve", str(tmp_path)], "neither a kubetune run directory"),
            (["serve", str(tmp_path), "--adapter", "oops"], "expected NAME=RUN_DIR"),
            (["serve", str(tmp_path), "--engine", "tgi"], "--engine tgi"),
            (["serve", str(tmp_path), "--dtype", "fp16", "--port", "0"], "--port 0"),
        )
    ):
        r = run_cli_subprocess(args, timeout=120) if i == 0 else run_cli_in_process(args, capfd)
        assert r.returncode == 2, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and words in lines[0], r.stderr


def _base(client) -> str:
    return next(m.id for m in client.models.list().data if getattr(m, "parent", None) is None)


RAW_BAD = [  # (endpoint, JSON text, status, the field the error names): each once killed or fooled the server
    ("completions", '{"model": "run-a", "prompt": "", "max_tokens": 4}', 400, "prompt"),
    ("completions", '{"model": "run-a", "prompt": "x", "seed": 18446744073709551616, "temperature": 1}', 400, "seed"),
    ("completions", '{"model": "run-a", "prompt": "x", "seed": -1}', 400, "seed"),
    ("completions", '{"model": "run-a", "prompt": "\\ud800"}', 400, "prompt"),
    ("completions", '{"model": "run-a", "prompt": "a\\u0000b"}', 400, "prompt"),
    ("completions", '{"model": "run-a", "prompt": "x", "max_tokens": true}', 400, "max_tokens"),
    ("completions", '{"model": "run-a", "prompt": "x", "stream": "yes"}', 400, "stream"),
    (
        "chat/completions",
        '{"model": "run-a", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "messages.0.content",
    ),
    (
        "chat/completions",
        '{"model": "run-a", "messages": [{"role": "user", "content": "x"}], "temperature": 1e400}',
        400,
        "temperature",
    ),
    (  # a lone surrogate inside a tool's schema reached the tokenizer through the chat template
        "chat/completions",
        (
            '{"model": "run-a", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required", '
            '"tools": [{"type": "function", "function": {"name": "f", '
            '"parameters": {"type": "object", "properties": {"a": {"const": "\\ud800"}}}}}]}'
        ),
        400,
        "tools.0.function.parameters.properties.a.const",
    ),
    (
        "chat/completions",
        '{"model": "run-a", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"k": "a\\u0000"}}',
        400,
        "chat_template_kwargs.k",
    ),
    (  # U+40000: SmolLM2's vocabulary has no token for its first byte; the grammar stops mid-answer
        "chat/completions",
        (
            '{"model": "run-a", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "response_format": '
            '{"type": "json_schema", "json_schema": {"name": "s", "schema": {"const": "\\ud8c0\\udc00"}}}}'
        ),
        400,
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), RAW_BAD)
def test_bad_input_is_a_4xx_naming_the_field_and_the_engine_lives_on(tiny_server, endpoint, body, status, param):
    r = httpx.post(
        f"{tiny_server.url}/v1/{endpoint}",
        content=body.encode(),
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = httpx.post(
        f"{tiny_server.url}/v1/completions",
        timeout=60,
        json={"model": "run-a", "prompt": "1 2", "max_tokens": 2, "temperature": 1e-39, "seed": 2**64 - 1},
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{tiny_server.url}/health", timeout=5).status_code == 200


def test_oversized_bodies_and_prompts_are_refused_before_the_work(tiny_server):
    big = {"model": "run-a", "prompt": "word " * 600_000}  # 3 MB: over the 2 MiB default
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=big, timeout=30)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
    long = {"model": "run-a", "prompt": "w" * 1_000_000}  # under the body limit, far over the prompt limit
    t0 = time.monotonic()
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=long, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert time.monotonic() - t0 < 5  # refused by its length, not after tokenizing it


FAR_OVER = 64 * 2**20  # 32 times the 2 MiB default of --max-body-bytes


def _far_over_chunks() -> Iterator[bytes]:
    yield b'{"model": "run-a", "prompt": "'
    for _ in range(FAR_OVER // 2**16):
        yield b"w" * 2**16
    yield b'"}'


def test_a_body_far_over_the_limit_gets_its_413_not_a_reset(tiny_server):
    """Python's own client (urllib.request: `Connection: close`, the whole body written before
    the answer is read) used to get a broken pipe: the server closed the connection on the
    unread body. It, the openai client and a chunked upload (no Content-Length) all read the
    413 now, and the server serves on."""
    body = b"".join(_far_over_chunks())
    headers = {"content-type": "application/json"}
    request = urllib.request.Request(f"{tiny_server.url}/v1/completions", data=body, headers=headers)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 413, refused.value
    assert "--max-body-bytes" in json.loads(refused.value.read())["error"]["message"]
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="run-a", prompt="w" * FAR_OVER)
    assert e.value.status_code == 413
    chunked = httpx.post(f"{tiny_server.url}/v1/completions", content=_far_over_chunks(), headers=headers, timeout=60)
    assert chunked.status_code == 413 and "--max-body-bytes" in chunked.json()["error"]["message"], chunked.text
    assert client.completions.create(model="run-a", prompt="1 2", max_tokens=2).choices[0].finish_reason


def test_a_dead_engine_fails_health_and_ready_and_answers_503_at_once(tiny_runs, monkeypatch):
    from .test_engine import _engine

    served, engine = _engine(tiny_runs, Limits())
    monkeypatch.setattr(engine, "_forward", lambda *a: (_ for _ in ()).throw(RuntimeError("broken kernel")))
    state = ServerState(served=served, engine=engine, metrics=engine.metrics)
    engine.start()
    ask = {"model": "run-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def check():
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            for _ in range(3):  # each request that meets the broken forward ends with an OpenAI error
                r = await c.post("/v1/chat/completions", json=ask)
                if r.status_code == 503:
                    break
                assert r.status_code == 500 and "broken kernel" in r.json()["error"]["message"]
            streamed = await c.post("/v1/chat/completions", json={**ask, "stream": True})
            assert streamed.status_code in (200, 503)
            if streamed.status_code == 200:  # an error object, never a finish_reason "error"
                assert '"error"' in streamed.text and '"finish_reason": "error"' not in streamed.text
            deadline = time.monotonic() + 30
            while engine.error is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert (await c.get("/health")).status_code == 503
            assert (await c.get("/ready")).status_code == 503
            r = await c.post("/v1/chat/completions", json=ask)
            assert r.status_code == 503 and "engine failed" in r.json()["error"]["message"]

    try:
        asyncio.run(check())
    finally:
        engine.stop()
