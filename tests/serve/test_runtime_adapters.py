"""Adapters loaded and unloaded while serving, against real `kubetune serve` processes, with
vLLM's routes: an adapter loaded at run time answers exactly as the same adapter declared at start."""

from __future__ import annotations

import httpx
import pytest

from kubetune.rundir import RunDir
from kubetune.serve.http.adapter_routes import VLLM_SWITCH, runtime_adapters_allowed

from .conftest import ServerProcess

pytestmark = pytest.mark.process

ASK = {"messages": [{"role": "user", "content": "What is 3 plus 3?"}], "max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def runtime_server(tiny_runs):
    server = ServerProcess([str(tiny_runs[0]), "--dtype", "fp32", "--allow-runtime-adapters"])
    yield server
    server.stop()


def _answer(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={**ASK, "model": model}, timeout=60)


def _models(url: str) -> dict[str, str | None]:
    return {m["id"]: m["parent"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def _error(response: httpx.Response, status: int, param: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and set(error) >= {"message", "type", "param", "code"}
    return str(error["message"])


def test_a_loaded_adapter_answers_as_declared_then_unloads(runtime_server, tiny_server, tiny_runs, tiny_model_dir):
    url, run_b = runtime_server.url, tiny_runs[1]
    declared = _answer(tiny_server.url, "qv").json()["choices"][0]["message"]["content"]
    assert _answer(url, "late").status_code == 404
    load = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(run_b)}, timeout=60)
    assert load.status_code == 200 and "late" in load.text
    peft_dir = RunDir(run_b).finished_weights(RunDir(run_b).recipe())  # the run's PEFT adapter directory
    load = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "peft", "lora_path": str(peft_dir)}, timeout=60)
    assert load.status_code == 200, load.text
    assert _models(url) == {tiny_model_dir.name: None, "run-a": tiny_model_dir.name, "late": tiny_model_dir.name,
                            "peft": tiny_model_dir.name}  # fmt: skip
    for name in ("late", "peft"):
        assert _answer(url, name).json()["choices"][0]["message"]["content"] == declared

    def content(server_url: str, model: str) -> str:
        return str(_answer(server_url, model).json()["choices"][0]["message"]["content"])

    assert content(url, "run-a") == content(tiny_server.url, "run-a")  # the declared one is untouched
    unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert unload.status_code == 200
    assert "late" in _error(_answer(url, "late"), 404, "model")
    assert _answer(url, "peft").json()["choices"][0]["message"]["content"] == declared
    again = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert "late" in _error(again, 404, "lora_name")


def test_bad_loads_are_400s_naming_the_field(runtime_server, tiny_runs, tiny_model_dir, tmp_path):
    url = runtime_server.url

    def load(body: dict) -> httpx.Response:
        return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)

    assert "already" in _error(load({"lora_name": "run-a", "lora_path": str(tiny_runs[1])}), 400, "lora_name")
    assert "neither" in _error(load({"lora_name": "x", "lora_path": str(tmp_path)}), 400, "lora_path")
    assert "neither" in _error(load({"lora_name": "x", "lora_path": str(tiny_model_dir)}), 400, "lora_path")
    other_base = tmp_path / "other"
    other_base.mkdir()
    config = (RunDir(tiny_runs[1]).finished_weights(RunDir(tiny_runs[1]).recipe()) / "adapter_config.json").read_text()
    (other_base / "adapter_config.json").write_text(config.replace(str(tiny_model_dir), "/models/another-base"))
    assert "another-base" in _error(load({"lora_name": "x", "lora_path": str(other_base)}), 400, "lora_path")
    assert load({"lora_name": "x"}).status_code == 400  # a missing field
    assert load({"lora_name": 3, "lora_path": str(tiny_runs[1])}).status_code == 400  # strict types
    assert "x" not in _models(url)


def test_without_the_switch_the_routes_do_not_exist(tiny_server, tiny_runs):
    body = {"lora_name": "late", "lora_path": str(tiny_runs[1])}
    assert httpx.post(f"{tiny_server.url}/v1/load_lora_adapter", json=body, timeout=10).status_code == 404
    assert (
        httpx.post(f"{tiny_server.url}/v1/unload_lora_adapter", json={"lora_name": "qv"}, timeout=10).status_code == 404
    )


def test_vllms_switch_turns_the_routes_on_as_the_flag_does():
    assert runtime_adapters_allowed(True, {})
    assert runtime_adapters_allowed(False, {VLLM_SWITCH: "True"}) and runtime_adapters_allowed(
        False, {VLLM_SWITCH: "1"}
    )
    assert not runtime_adapters_allowed(False, {}) and not runtime_adapters_allowed(False, {VLLM_SWITCH: "False"})
