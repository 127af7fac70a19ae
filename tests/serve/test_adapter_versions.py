"""Versions of an adapter behind one alias, more adapters than the layers hold (--max-loras), and the
registry read at start: against real `kubetune serve` processes, each answer compared with the same
adapter's own greedy answer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from kubetune.rundir import RunDir
from tests.kit.paths import REPO

from .conftest import ServerProcess, metric

pytestmark = pytest.mark.process

ASK = {"messages": [{"role": "user", "content": "What is 3 plus 3?"}], "max_tokens": 16, "temperature": 0}
LONG = 900  # tokens of a stream kept running while the test changes the server under it
VERSION_HEADER = "x-kubetune-adapter-version"


def peft_dir(run: Path) -> Path:
    return RunDir(run).finished_weights(RunDir(run).recipe())


@pytest.fixture(scope="module")
def adapters(tiny_runs, tmp_path_factory) -> dict[str, Path]:
    """Three different PEFT adapters of the tiny Llama: run a's, run b's, and run b's with B negated."""
    from safetensors.torch import load_file, save_file

    a, b = (peft_dir(r) for r in tiny_runs)
    flipped = tmp_path_factory.mktemp("flipped") / "adapter"
    shutil.copytree(b, flipped)
    weights = load_file(flipped / "adapter_model.safetensors")
    save_file({k: -v if "lora_B" in k else v for k, v in weights.items()}, flipped / "adapter_model.safetensors")
    return {"a": a, "b": b, "flip": flipped}


@pytest.fixture(scope="module")
def server(tiny_runs):
    server = ServerProcess([str(tiny_runs[0]), "--dtype", "fp32", "--allow-runtime-adapters"])
    yield server
    server.stop()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def load(url: str, name: str, path: Path) -> None:
    r = post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 200, r.text


def ask(url: str, model: str, **extra) -> httpx.Response:
    r = post(url, "/v1/chat/completions", {**ASK, "model": model, **extra})
    assert r.status_code == 200, r.text
    return r


def content(url: str, model: str, **extra) -> str:
    return str(ask(url, model, **extra).json()["choices"][0]["message"]["content"])


def error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    return str(r.json()["error"]["message"])


def lora_info(server: ServerProcess) -> dict[str, str]:
    """The labels of vllm:lora_requests_info, read with prometheus_client's parser."""
    labels = [dict(ls) for (name, ls), _ in server.metrics().items() if name == "vllm:lora_requests_info"]
    assert len(labels) == 1, labels  # one series, the current one
    return labels[0]


def test_an_alias_routes_by_weight_and_rolls_back(server, adapters):
    url = server.url
    load(url, "w@v1", adapters["a"])
    aliases = httpx.get(f"{url}/v1/lora_aliases", timeout=10).json()["data"]
    assert {"alias": "w", "weights": {"w@v1": 100}} in aliases  # the first version made its alias
    load(url, "w@v2", adapters["b"])
    assert {"alias": "w", "weights": {"w@v1": 100}} in httpx.get(f"{url}/v1/lora_aliases", timeout=10).json()["data"]
    r = post(url, "/v1/lora_aliases", {"alias": "w", "weights": {"w@v1": 90, "w@v2": 10}})
    assert r.status_code == 200 and r.json()["weights"] == {"w@v1": 90, "w@v2": 10}
    served = []
    for i in range(200):
        if i % 10 == 0:  # tokenizing for an alias reads a version without counting a request
            assert post(url, "/tokenize", {"model": "w", "prompt": "x"}).status_code == 200
        r = ask(url, "w", max_tokens=1)
        assert r.json()["model"] == r.headers[VERSION_HEADER]
        served.append(r.headers[VERSION_HEADER])
    assert served.count("w@v2") == 20 and served.count("w@v1") == 180  # exact: smooth weighted round robin
    post(url, "/v1/lora_aliases", {"alias": "w", "weights": {"w@v1": 100, "w@v2": 0}})  # roll back
    assert {ask(url, "w", max_tokens=1).headers[VERSION_HEADER] for _ in range(20)} == {"w@v1"}
    models = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    base = models["run-a"]["parent"]
    assert models["w@v1"]["parent"] == models["w@v2"]["parent"] == models["w"]["parent"] == base
    assert models["w"]["alias_weights"] == {"w@v1": 100, "w@v2": 0}


def test_model_field_and_header_name_the_version_streamed_or_not(server, adapters):
    url = server.url
    load(url, "h@v1", adapters["a"])
    load(url, "h@v2", adapters["b"])
    r = ask(url, "h@v2")  # named directly: exactly it, whatever the alias says
    assert r.json()["model"] == r.headers[VERSION_HEADER] == "h@v2"
    assert r.json()["choices"][0]["message"]["content"] == content(url, "h@v2")
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**ASK, "model": "h", "stream": True}) as s:
        assert s.headers[VERSION_HEADER] == "h@v1"
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"h@v1"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == content(url, "h@v1")
    assert VERSION_HEADER not in ask(url, "run-a").headers  # an adapter without versions


def test_the_refusals_are_400s_naming_the_field(server, adapters):
    url = server.url
    load(url, "r@v1", adapters["a"])
    load(url, "r@v2", adapters["b"])

    def alias(body: dict) -> httpx.Response:
        return post(url, "/v1/lora_aliases", body)

    assert "'r@v9' is not a served adapter" in error(alias({"alias": "r", "weights": {"r@v9": 1}}), "weights")
    assert "non-negative" in error(alias({"alias": "r", "weights": {"r@v1": -1, "r@v2": 5}}), "weights")
    assert "at least one weight" in error(alias({"alias": "r", "weights": {"r@v1": 0, "r@v2": 0}}), "weights")
    assert error(alias({"alias": "r", "weights": {"r@v1": 1.5}}), "weights")  # weights are integers
    assert "served model" in error(alias({"alias": "run-a", "weights": {"r@v1": 1}}), "alias")
    assert "plain NAME" in error(alias({"alias": "r@v3", "weights": {"r@v1": 1}}), "alias")
    unload = post(url, "/v1/unload_lora_adapter", {"lora_name": "r@v1"})
    assert "alias 'r'" in error(unload, "lora_name")  # the alias still sends it requests
    assert "NAME@vN" in error(
        post(url, "/v1/load_lora_adapter", {"lora_name": "r@v0", "lora_path": str(adapters["a"])}), "lora_name"
    )
    assert "alias" in error(
        post(url, "/v1/load_lora_adapter", {"lora_name": "r", "lora_path": str(adapters["a"])}), "lora_name"
    )
    assert content(url, "r") == content(url, "r@v1")  # nothing refused changed the route


def test_the_last_version_of_an_alias_unloads_and_the_alias_goes_with_it(server, adapters):
    url = server.url
    load(url, "solo@v1", adapters["a"])
    assert content(url, "solo") == content(url, "solo@v1")
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "solo@v1"}).status_code == 200
    assert ask_status(url, "solo") == ask_status(url, "solo@v1") == 404
    assert "solo" not in {a["alias"] for a in httpx.get(f"{url}/v1/lora_aliases", timeout=10).json()["data"]}


def ask_status(url: str, model: str) -> int:
    return post(url, "/v1/chat/completions", {**ASK, "model": model, "max_tokens": 1}).status_code


def test_a_stream_is_answered_by_its_version_across_an_alias_swap_and_an_unload(server, adapters):
    url = server.url
    load(url, "s@v1", adapters["a"])
    load(url, "s@v2", adapters["b"])
    long = {"max_tokens": LONG, "ignore_eos": True}
    own = {v: content(url, f"s@{v}", **long) for v in ("v1", "v2")}
    assert own["v1"] != own["v2"]
    body = {**ASK, **long, "model": "s", "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as s:
        assert s.headers[VERSION_HEADER] == "s@v1"
        lines = s.iter_lines()
        got = [json.loads(line[6:]) for line in _until_content(lines)]
        r = post(url, "/v1/lora_aliases", {"alias": "s", "weights": {"s@v2": 100, "s@v1": 0}})
        assert r.status_code == 200, r.text
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": "s@v1"}).status_code == 200
        assert "s@v1" not in {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        assert lora_info(server)["running_lora_adapters"] == "s@v1"  # still generating after the unload
        got += [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert {c["model"] for c in got} == {"s@v1"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in got) == own["v1"]
    assert got[-1]["choices"][0]["finish_reason"] == "length"
    assert ask(url, "s").headers[VERSION_HEADER] == "s@v2"
    assert post(url, "/v1/chat/completions", {**ASK, "model": "s@v1"}).status_code == 404


def _until_content(lines):
    """The stream's lines up to and including its first chunk of text (the sequence is decoding)."""
    for line in lines:
        if line.startswith("data: {"):
            yield line
            if json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return


def test_the_openai_client_calls_an_alias(server, adapters):
    load(server.url, "o@v1", adapters["b"])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model="o", messages=ASK["messages"], max_tokens=16, temperature=0
    )
    answer = raw.parse()
    assert answer.model == raw.headers[VERSION_HEADER] == "o@v1"
    assert answer.choices[0].message.content == content(server.url, "o@v1")
    assert "o" in {m.id for m in client.models.list().data}


# --- more adapters than the layers hold ---------------------------------------------------------
@pytest.fixture(scope="module")
def one_resident(tiny_runs, adapters):
    """Three adapters (the run's, qv, flip) over one slot in the layers."""
    args = [str(tiny_runs[0]), "--adapter", f"qv={tiny_runs[1]}", "--dtype", "fp32", "--max-loras", "1"]
    server = ServerProcess([*args, "--allow-runtime-adapters"])
    load(server.url, "flip", adapters["flip"])
    yield server
    server.stop()


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_three_adapters_take_turns_in_one_slot_each_answering_as_alone(one_resident, tiny_server, server, adapters):
    load(server.url, "flip-alone", adapters["flip"])
    alone = {"run-a": content(tiny_server.url, "run-a"), "qv": content(tiny_server.url, "qv")}
    alone["flip"] = content(server.url, "flip-alone")
    assert len(set(alone.values())) == 3  # three different adapters
    url, before = one_resident.url, one_resident.metrics()
    for _ in range(2):
        for name in ("run-a", "qv", "flip"):
            assert content(url, name) == alone[name], name
    after = one_resident.metrics()
    evictions = metric(after, "kubetune:lora_adapter_evictions_total") - metric(
        before, "kubetune:lora_adapter_evictions_total"
    )
    loads = metric(after, "kubetune:lora_adapter_load_seconds_count") - metric(
        before, "kubetune:lora_adapter_load_seconds_count"
    )
    assert evictions >= 5 and loads >= 5  # every turn but perhaps the first took the slot from another
    assert metric(after, "kubetune:lora_adapters_resident") == 1
    assert lora_info(one_resident)["max_lora"] == "1"


def test_a_request_waits_while_every_slot_is_busy(one_resident, tiny_server):
    url = one_resident.url
    body = {**ASK, "model": "qv", "stream": True, "max_tokens": LONG, "ignore_eos": True}
    waited: dict[str, httpx.Response] = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as s:
        lines = s.iter_lines()  # kept open: closing the iterator would close the connection (an abort)
        list(_until_content(lines))  # qv holds the only slot
        late = threading.Thread(target=lambda: waited.update(r=ask(url, "run-a")))
        late.start()
        deadline = time.monotonic() + 20
        while lora_info(one_resident)["waiting_lora_adapters"] != "run-a":
            assert time.monotonic() < deadline, lora_info(one_resident)
            time.sleep(0.02)
        info = lora_info(one_resident)
        assert info["running_lora_adapters"] == "qv" and info["max_lora"] == "1"
        assert late.is_alive()  # it cannot run while qv's request does
    late.join(timeout=60)  # the stream closed: qv's request ends, run-a takes the slot
    assert waited["r"].json()["choices"][0]["message"]["content"] == content(tiny_server.url, "run-a")
    deadline = time.monotonic() + 10
    while lora_info(one_resident)["running_lora_adapters"]:  # the engine publishes every turn
        assert time.monotonic() < deadline
        time.sleep(0.02)


# --- the registry at start ----------------------------------------------------------------------
def write(path: Path, base: str, versions: dict[str, str], weights: dict[str, int]) -> Path:
    entry = {"versions": {v: {"path": p} for v, p in versions.items()}, "weights": weights}
    path.write_text(json.dumps({"base": {"name": base, "revision": "main"}, "adapters": {"reg": entry}}))
    return path


def test_the_registry_is_served_before_ready(tiny_model_dir, adapters, tmp_path):
    shutil.copytree(adapters["a"], tmp_path / "reg" / "v1")  # a path relative to the file's folder
    registry = write(tmp_path / "registry.json", str(tiny_model_dir), {"v1": "reg/v1", "v2": str(adapters["b"])},
                     {"v1": 50, "v2": 50})  # fmt: skip
    seen: list[int] = []
    listed: set[str] = set()

    def ready(url: str) -> bool:
        try:
            status = httpx.get(f"{url}/ready", timeout=5).status_code
        except httpx.TransportError:
            return False
        seen.append(status)
        if status == 200:  # at once: everything of the registry is there already
            listed.update(m["id"] for m in httpx.get(f"{url}/v1/models", timeout=5).json()["data"])
        return status == 200

    server = ServerProcess([str(tiny_model_dir), "--dtype", "fp32", "--adapter-registry", str(registry)], ready=ready)
    try:
        assert seen[0] == 503 and seen[-1] == 200 and set(seen) == {503, 200}
        assert {"reg", "reg@v1", "reg@v2"} <= listed
        picked = [ask(server.url, "reg", max_tokens=1).headers[VERSION_HEADER] for _ in range(4)]
        assert sorted(picked) == ["reg@v1", "reg@v1", "reg@v2", "reg@v2"]
        assert content(server.url, "reg@v1") != content(server.url, "reg@v2")
    finally:
        server.stop()


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
@pytest.mark.parametrize("wrong", ["registry", "adapter"])
def test_a_wrong_base_in_the_registry_exits_2_in_one_line(tiny_model_dir, adapters, tmp_path, wrong):
    other = tmp_path / "other"
    shutil.copytree(adapters["a"], other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": "/models/another"}))
    base = "/models/another" if wrong == "registry" else str(tiny_model_dir)
    registry = write(tmp_path / "registry.json", base, {"v1": str(adapters["a"]), "v2": str(other)}, {})
    cmd = [sys.executable, "-m", "kubetune", "serve", str(tiny_model_dir), "--engine", "native"]
    done = subprocess.run([*cmd, "--adapter-registry", str(registry)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "/models/another" in lines[0] and str(tiny_model_dir) in lines[0], lines
    where = "base.name" if wrong == "registry" else "adapters.reg.versions.v2"
    assert where in lines[0]


def test_vllm_reads_no_registry(tiny_model_dir, tmp_path, capfd):
    from tests.kit.cli import run_cli_in_process

    registry = write(tmp_path / "registry.json", str(tiny_model_dir), {"v1": "x"}, {})
    args = ["serve", str(tiny_model_dir), "--engine", "vllm", "--adapter-registry", str(registry)]
    done = run_cli_in_process(args, capfd)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "kubetune: error: --adapter-registry: served by --engine native only (vLLM reads no registry file)"
    ], done.stderr


def test_adapter_root_confines_runtime_loads_to_the_volume(tiny_model_dir, adapters, tmp_path):
    """--adapter-root (a ModelServer's replicas: the adapter volume): a lora_path outside it, or a
    link inside it that leads out, is a 400 naming lora_path; a path inside it loads."""
    root = tmp_path / "volume"
    shutil.copytree(adapters["a"], root / "inside" / "v1")
    (root / "escape").symlink_to(adapters["b"], target_is_directory=True)
    args = [str(tiny_model_dir), "--dtype", "fp32", "--allow-runtime-adapters", "--adapter-root", str(root)]
    server = ServerProcess(args)
    try:
        url = server.url
        assert "outside the server's adapter root" in error(
            post(url, "/v1/load_lora_adapter", {"lora_name": "out", "lora_path": str(adapters["b"])}), "lora_path"
        )
        for sneaky in (root / "escape", root / "inside" / ".." / ".." / adapters["b"].name):
            refused = post(url, "/v1/load_lora_adapter", {"lora_name": "out", "lora_path": str(sneaky)})
            assert "outside the server's adapter root" in error(refused, "lora_path")
        load(url, "in@v1", root / "inside" / "v1")
        assert content(url, "in@v1")
    finally:
        server.stop()
