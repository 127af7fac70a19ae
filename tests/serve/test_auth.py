"""API keys (`--api-key`, `--api-key-file`, $KUBETUNE_API_KEY, $VLLM_API_KEY): the middleware's
path rules in-process, then one real `kubetune serve` holding keys from all four sources."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from kubetune.errors import UserError
from kubetune.serve.http.api import create_app
from kubetune.serve.http.auth import ApiKeyAuth, load_api_keys
from kubetune.serve.http.state import ApiOptions, ServerState
from tests.kit.cli import run_cli_subprocess

from .conftest import ServerProcess

pytestmark = pytest.mark.process

FLAG_KEY = "flag-key-1234"
FILE_KEYS = ("file-key-aaaa", "file-key-bbbb")
ENV_KEYS = ("env-key-cccc", "env-key-dddd")
VLLM_ENV_KEY = "vllm-key-eeee"
ALL_KEYS = (FLAG_KEY, *FILE_KEYS, *ENV_KEYS, VLLM_ENV_KEY)


def _key_file(tmp: Path) -> Path:
    path = tmp / "keys.txt"
    path.write_text(f"# the keys of team a\n{FILE_KEYS[0]}\n\n  {FILE_KEYS[1]}  \n# retired: old-key\n")
    return path


def test_keys_from_flags_files_and_both_variables_in_order_without_repeats(tmp_path):
    env = {"KUBETUNE_API_KEY": f" {ENV_KEYS[0]}, {ENV_KEYS[1]},", "VLLM_API_KEY": VLLM_ENV_KEY}
    keys = load_api_keys([FLAG_KEY, FILE_KEYS[0]], [_key_file(tmp_path)], env)
    assert keys == ALL_KEYS
    assert load_api_keys([], [], {}) == ()


@pytest.mark.parametrize(
    ("content", "why"),
    [(None, "cannot read it"), ("# only a comment\n\n", "holds no key"), ("two words\n", "without spaces")],
)
def test_a_bad_key_file_is_one_error_naming_the_option(tmp_path, content, why):
    path = tmp_path / "keys.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError) as e:
        load_api_keys([], [path], {})
    assert e.value.problems == [e.value.problems[0]] and "--api-key-file" in str(e.value) and why in str(e.value)


async def _status(client: httpx.AsyncClient, method: str, path: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return (await client.request(method, path, headers=headers)).status_code


def test_every_route_but_the_probes_needs_a_key():
    """Unknown routes too (a route added later is protected), whatever the method."""

    async def check() -> None:
        app = create_app(ServerState(ApiOptions(api_keys=("k-one", "k-two"))))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert await _status(c, "GET", "/health") == 200
            assert await _status(c, "GET", "/ready") == 503  # loading, but answered without a key
            assert await _status(c, "GET", "/metrics") == 200
            for method, path in [
                ("GET", "/v1/models"),
                ("POST", "/v1/chat/completions"),
                ("POST", "/v1/load_lora_adapter"),
                ("POST", "/tokenize"),
                ("GET", "/"),
                ("GET", "/health/../v1/models"),
                ("OPTIONS", "/v1/models"),
            ]:
                assert await _status(c, method, path) == 401, (method, path)
                assert await _status(c, method, path, "k-wrong") == 401, (method, path)
                assert await _status(c, method, path, "k-two") != 401, (method, path)
            assert await _status(c, "GET", "/v1/models", "k-one") == 503  # past the check: no model yet
            lower = await c.get("/v1/models", headers={"Authorization": "bearer k-one"})
            assert lower.status_code == 503  # the scheme is case-insensitive (RFC 7235)
            basic = await c.get("/v1/models", headers={"Authorization": "Basic k-one"})
            assert basic.status_code == 401

    asyncio.run(check())


def test_without_keys_every_route_is_open():
    async def check() -> None:
        app = create_app(ServerState())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert await _status(c, "GET", "/v1/models") == 503
            assert await _status(c, "GET", "/no-such-route") == 404  # past the middleware, to the router

    asyncio.run(check())


def test_a_refused_request_is_answered_without_reading_its_body():
    sent: list[dict] = []

    async def inner(scope, receive, send):  # pragma: no cover - must never be reached
        raise AssertionError("the request got past the key check")

    async def receive():
        raise AssertionError("the body was read")

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"authorization", b"Bearer x")]}
    asyncio.run(ApiKeyAuth(inner, ("right",))(scope, receive, send))
    assert sent[0]["status"] == 401
    assert dict(sent[0]["headers"])[b"www-authenticate"].startswith(b"Bearer")


# ------------------------------------------------------------------ a real server


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir, tmp_path_factory):
    keys = _key_file(tmp_path_factory.mktemp("keys"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KUBETUNE_API_KEY", ",".join(ENV_KEYS))
        env.setenv("VLLM_API_KEY", VLLM_ENV_KEY)
        server = ServerProcess([str(tiny_model_dir), "--api-key", FLAG_KEY, "--api-key-file", str(keys)])
    yield server
    server.stop()


def test_no_key_and_a_wrong_key_get_openai_shaped_401s(keyed_server):
    ask = {"model": "m", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer not-a-key"}, {"Authorization": FLAG_KEY}):
        r = httpx.post(f"{keyed_server.url}/v1/completions", json=ask, headers=headers, timeout=10)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"].startswith("Bearer")
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert "Authorization: Bearer" in error["message"] or "not valid" in error["message"]


def test_each_key_from_every_source_is_accepted(keyed_server):
    for key in ALL_KEYS:
        r = httpx.get(f"{keyed_server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200, key
        assert r.json()["data"], key


def test_the_probes_and_metrics_need_no_key(keyed_server):
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{keyed_server.url}{path}", timeout=10).status_code == 200, path


def test_the_openai_client_with_its_api_key(keyed_server):
    good = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=FILE_KEYS[1], max_retries=0, timeout=60)
    model = good.models.list().data[0].id
    answer = good.completions.create(model=model, prompt="1 2 3", max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_the_log_says_how_many_keys_and_never_a_key(keyed_server):
    log = keyed_server.stop()
    assert f"API keys: {len(ALL_KEYS)} configured" in log
    assert not [key for key in ALL_KEYS if key in log]


def test_a_missing_key_file_stops_the_server_with_one_line(tmp_path, tiny_model_dir):
    missing = tmp_path / "no-such-keys.txt"
    result = run_cli_subprocess(["serve", str(tiny_model_dir), "--api-key-file", str(missing)], timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--api-key-file" in lines[0] and str(missing) in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def _fake_vllm(tmp_path: Path) -> tuple[Path, Path]:
    """An executable standing in for vLLM's Python: it writes down its arguments and VLLM_API_KEY."""
    seen = tmp_path / "seen.txt"
    python = tmp_path / "vllm-python"
    python.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" "VLLM_API_KEY=$VLLM_API_KEY" > {seen}\n')
    python.chmod(0o755)
    return python, seen


@pytest.mark.parametrize("keys", [("only-key-1234",), ("key-one-1234", "key-two-5678")])
def test_engine_vllm_gets_the_keys_and_the_log_does_not(tmp_path, tiny_model_dir, keys):
    """One key travels in vLLM's VLLM_API_KEY (not on the command line), several as --api-key."""
    python, seen = _fake_vllm(tmp_path)
    flags = [arg for key in keys for arg in ("--api-key", key)]
    env = {"KUBETUNE_VLLM_PYTHON": str(python), "VLLM_API_KEY": "", "KUBETUNE_API_KEY": ""}
    result = run_cli_subprocess(["serve", str(tiny_model_dir), "--engine", "vllm", *flags], env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    args = seen.read_text().splitlines()
    if len(keys) == 1:
        assert args[-1] == f"VLLM_API_KEY={keys[0]}" and "--api-key" not in args
    else:
        assert args[-1] == "VLLM_API_KEY=" and args[-len(keys) - 2 : -1] == ["--api-key", *keys]
    assert f"API keys: {len(keys)} configured" in result.stderr
    assert not [key for key in keys if key in result.stderr]
