"""A ModelServer and a FineTune of `spec.serve.server`, run by the operator (kopf) against kmock,
with REAL `kubetune serve` processes on 127.0.0.1 as the server's replicas: kmock's pods point
at them (status.podIP 127.0.0.1, their `http` container port the process's port).

What the cluster would do and these tests play: the training operator (the PyTorchJob's
Succeeded condition), and the adapter-export Job (its command, run here as the pod would run it,
with the run directory and the adapter volume as local paths; then its `succeeded`)."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from kubetune.export.adapter_install import main as run_install
from kubetune.k8s.names import server_selector
from tests.serve.conftest import ServerProcess, train_tiny_run

from .conftest import NAMESPACE, running_operator, wait_for

pytestmark = pytest.mark.process

MS = ("kubetune.io/v1alpha1", "ModelServer")
PYTORCHJOB = ("kubeflow.org/v1", "PyTorchJob")
KEY = "replicas-key"  # the server's API key: in its Secret (shared-api-key), required by the replicas
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = {"messages": [{"role": "user", "content": "What is 3 plus 3?"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model_dir):
    from tests.conftest import write_qa_file

    root = tmp_path_factory.mktemp("ms-run")
    return train_tiny_run(root / "run", tiny_model_dir, write_qa_file(root / "qa.jsonl"), "lora.r=4")


def _replica(tiny_model_dir, root: Path, runtime: bool = True, **kwargs: Any) -> ServerProcess:
    """A replica as the ModelServer renders it: the adapter registry read at start, runtime loads
    only from the adapter volume, --max-loras, and the server's API key."""
    args = [str(tiny_model_dir), "--dtype", "fp32", "--adapter-registry", str(root / "registry.json")]
    args += ["--adapter-root", str(root), "--max-loras", "4", "--api-key", KEY]
    args += ["--allow-runtime-adapters"] if runtime else []
    return ServerProcess(args, **kwargs)


@pytest.fixture
def replicas(tiny_model_dir, tmp_path):
    started = [_replica(tiny_model_dir, tmp_path / "adapters"), _replica(tiny_model_dir, tmp_path / "adapters")]
    yield started
    for server in started:
        server.stop()


def _variant(run: Path, dest: Path, seed: int) -> Path:
    """A copy of the tiny run whose adapter has weights of its own (another tuning's result)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(run, dest)
    weights_file = dest / "adapter" / "adapter_model.safetensors"
    weights = load_file(weights_file)
    generator = torch.Generator().manual_seed(seed)
    for key in [k for k in weights if "lora_B" in k]:
        weights[key] = weights[key] + 0.5 * torch.randn(weights[key].shape, generator=generator)
    save_file(weights, weights_file)
    return dest


def _answer(server: ServerProcess, model: str) -> list[float]:
    """The greedy completion's log-probabilities: what the model's weights say, to compare."""
    body = {"model": model, "prompt": "What is 3 plus 3?", "max_tokens": 3, "temperature": 0, "logprobs": 1}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return [round(x, 4) for x in response.json()["choices"][0]["logprobs"]["token_logprobs"]]


def _models(server: ServerProcess) -> set[str]:
    """The adapters a replica serves, by version (NAME@vN; the alias NAME beside them is left out)."""
    data = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    return {m["id"] for m in data if m.get("parent") and "@" in m["id"]}


def _load(server: ServerProcess, name: str, path: str) -> None:
    response = httpx.post(
        f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=AUTH, timeout=60
    )
    assert response.status_code == 200, response.text


def _unload(server: ServerProcess, name: str) -> None:
    response = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text


def _pods(cluster, servers: list[ServerProcess]) -> None:
    """The server's pods as the kubelet reports them: running, ready, at the processes' ports."""
    for i, server in enumerate(servers):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"shared-{i}", "namespace": NAMESPACE, "labels": server_selector("shared")},
            "spec": {"containers": [{"name": "server", "ports": [{"name": "http", "containerPort": server.port}]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
        cluster.client.create(pod)


def _model_server(cluster, base: str, adapters_root: str) -> None:
    """The ModelServer `shared`, and its key's Secret (what the replicas were started with)."""
    import base64

    key = {"api-key": base64.b64encode(KEY.encode()).decode()}
    meta = {"name": "shared-api-key", "namespace": NAMESPACE}
    cluster.client.create({"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": key})
    meta = {"name": "shared", "namespace": NAMESPACE, "uid": "uid-shared", "generation": 1, "resourceVersion": "1"}
    spec = {"base": {"model": base}, "replicas": 2, "adapterStorage": {"mountPath": adapters_root}}
    cluster.client.create({"apiVersion": MS[0], "kind": MS[1], "metadata": meta, "spec": spec})


def _ms_status(cluster) -> dict:
    return (cluster.client.get(*MS, "shared", NAMESPACE) or {}).get("status") or {}


def _train_and_export(cluster, name: str, run_dir, recipe_model: str, serve: dict) -> dict:
    """Apply the FineTune, succeed its job, run its adapter-export Job's command; its Job object."""
    recipe = {"model": {"name_or_path": recipe_model}, "train": {"max_steps": 2}, "k8s": {"amx_label": None}}
    cluster.apply_finetune(name, {"recipe": recipe, "profile": "cpu", "serve": serve})
    wait_for(lambda: cluster.get(*PYTORCHJOB, name), message="the PyTorchJob")
    cluster.set_status(*PYTORCHJOB, name, {"conditions": [{"type": "Succeeded", "status": "True"}]})
    job = wait_for(lambda: cluster.get("batch/v1", "Job", f"{name}-adapter-export"), message="the export Job")
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["python", "-m", "kubetune.export.adapter_install", f"/data/runs/{name}"]
    assert run_install([str(run_dir), *command[4:]]) == 0  # what the Job's pod runs, on the claim's paths
    cluster.set_status("batch/v1", "Job", f"{name}-adapter-export", {"succeeded": 1})
    return job


def _loaded_everywhere(cluster, name: str) -> dict | None:
    condition = cluster.condition(name, "AdapterLoaded")
    return condition if condition and condition["status"] == "True" else None


def test_three_finetunes_serve_their_own_adapters_on_every_replica_then_delete_unloads_one(
    cluster, replicas, tiny_run, tiny_model_dir, tmp_path
):
    root = tmp_path / "adapters"
    _model_server(cluster, str(tiny_model_dir), str(root))
    _pods(cluster, replicas)
    names = ("cardio", "derm", "neuro")
    runs = {name: _variant(tiny_run, tmp_path / "runs" / name, seed) for seed, name in enumerate(names)}
    with running_operator(cluster):
        jobs = {
            name: _train_and_export(cluster, name, runs[name], str(tiny_model_dir), {"server": "shared"})
            for name in names
        }
        mounts = jobs["cardio"]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "adapters", "mountPath": str(root), "subPath": "adapters"} in mounts
        for name in names:
            loaded = wait_for(lambda n=name: _loaded_everywhere(cluster, n), timeout=90, message=f"{name} loaded")
            assert loaded["message"].splitlines() == ["shared-0: loaded", "shared-1: loaded"]
        status = cluster.status("cardio")
        assert status["phase"] == "Serving"
        path = f"{root}/cardio/v1"
        assert status["adapter"] == {"server": "shared", "name": "cardio", "version": "v1",
                                     "servedName": "cardio@v1", "path": path, "registered": True}  # fmt: skip
        assert status["endpoint"] == "http://shared.kubetune.svc:8000/v1"
        served = {f"{name}@v1" for name in names}
        assert all(_models(r) == served for r in replicas)
        # the runtime routes answer only with the server's key (the operator read it from the Secret)
        bare = {"lora_name": "x@v1", "lora_path": path}
        assert httpx.post(f"{replicas[0].url}/v1/load_lora_adapter", json=bare, timeout=10).status_code == 401
        # each answers with its own weights, the same on both replicas
        answers = {name: _answer(replicas[0], f"{name}@v1") for name in names}
        assert len({tuple(a) for a in answers.values()}) == 3, answers
        assert all(_answer(replicas[1], name) == answers[name] for name in names)  # the alias NAME too
        ms = wait_for(lambda: _ms_status(cluster).get("adapterCount") == 3 and _ms_status(cluster))
        assert ms["readyReplicas"] == 2 and sorted(a["finetune"] for a in ms["adapters"]) == list(names)
        assert cluster.get("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective", "cardio-v1")

        cluster.client.delete("kubetune.io/v1alpha1", "FineTune", "cardio", NAMESPACE)
        wait_for(lambda: cluster.finetune("cardio") is None, message="the FineTune gone")
        # the delete handler unloads it at once; where one of its calls failed on a busy machine,
        # the ModelServer's timer does (handlers._deleted)
        unloaded = {"derm@v1", "neuro@v1"}
        wait_for(lambda: all(_models(r) == unloaded for r in replicas), timeout=30, message="cardio unloaded")
        unregister = cluster.get("batch/v1", "Job", "cardio-v1-adapter-unregister")
        assert unregister["metadata"]["ownerReferences"][0]["kind"] == "ModelServer"
        assert unregister["spec"]["template"]["spec"]["containers"][0]["command"][3:] == [
            "--unregister", "--name", "cardio", "--version", "v1", "--root", "/data/adapters"
        ]  # fmt: skip
        assert (root / "cardio" / "v1" / "adapter_config.json").is_file()  # Retain: the files stay
        run_install(["--unregister", "--name", "cardio", "--version", "v1", "--root", str(root)])  # its pod's run
        wait_for(lambda: _ms_status(cluster).get("adapterCount") == 2, message="the registry without it")
        objective = ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective", "cardio-v1")
        wait_for(lambda: cluster.get(*objective) is None, message="its InferenceObjective gone")

        # a replica killed and started again is not ready until the registry's adapters are back
        replicas[0].proc.kill()
        replicas[0].stop()
        at_ready: set[str] = set()

        def ready_with_adapters(url: str) -> bool:
            try:
                if httpx.get(f"{url}/ready", timeout=5).status_code != 200:
                    return False
            except httpx.TransportError:
                return False
            data = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=5).json()["data"]
            at_ready.update(m["id"] for m in data if "@" in m["id"])
            return True

        replicas[0] = _replica(tiny_model_dir, root, ready=ready_with_adapters)
        assert at_ready == {"derm@v1", "neuro@v1"}
        assert _answer(replicas[0], "derm@v1") == answers["derm"]


def test_an_adapter_of_another_base_is_refused_naming_both(cluster, tiny_model_dir, tmp_path):
    recipe = {"model": {"name_or_path": str(tiny_model_dir)}, "k8s": {"amx_label": None}}
    with running_operator(cluster):
        # the server exists: refused before any training
        _model_server(cluster, "org/another-base", str(tmp_path / "adapters"))
        cluster.apply_finetune("early", {"recipe": recipe, "serve": {"server": "shared"}})
        valid = wait_for(lambda: cluster.condition("early", "Valid"), message="the Valid condition")
        assert (valid["status"], valid["reason"]) == ("False", "WrongBase")
        assert f"trained on {tiny_model_dir}@default" in valid["message"]
        assert "ModelServer shared serves org/another-base@default" in valid["message"]
        assert cluster.get(*PYTORCHJOB, "early") is None
        # the server appears after the FineTune: refused when training has succeeded, before the export
        cluster.apply_finetune("late", {"recipe": recipe, "serve": {"server": "later"}})
        wait_for(lambda: cluster.get(*PYTORCHJOB, "late"), message="the PyTorchJob")
        meta = {"name": "later", "namespace": NAMESPACE, "uid": "uid-later", "resourceVersion": "1"}
        cluster.client.create({"apiVersion": MS[0], "kind": MS[1], "metadata": meta,
                               "spec": {"base": {"model": "org/another-base"}}})  # fmt: skip
        cluster.set_status(*PYTORCHJOB, "late", {"conditions": [{"type": "Succeeded", "status": "True"}]})
        failed = wait_for(lambda: cluster.condition("late", "Failed"), message="the Failed condition")
        assert failed["reason"] == "WrongBase" and "ModelServer later serves org/another-base" in failed["message"]
        assert cluster.status("late")["phase"] == "Failed"
        assert cluster.get("batch/v1", "Job", "late-adapter-export") is None  # nothing exported
        # a server without a Secret of its own gets one: a random key the operator and its pods share
        secret = wait_for(lambda: cluster.get("v1", "Secret", "later-api-key"), message="the key's Secret")
        assert secret["metadata"]["ownerReferences"][0]["kind"] == "ModelServer" and secret["data"]["api-key"]


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_a_replica_that_cannot_load_is_named_and_the_other_serves(cluster, tiny_run, tiny_model_dir, tmp_path):
    root = tmp_path / "adapters"
    good, refusing = (
        _replica(tiny_model_dir, root),
        _replica(tiny_model_dir, root, runtime=False),
    )  # no runtime routes: 404
    try:
        _model_server(cluster, str(tiny_model_dir), str(tmp_path / "adapters"))
        _pods(cluster, [good, refusing])
        with running_operator(cluster):
            _train_and_export(cluster, "cardio", tiny_run, str(tiny_model_dir), {"server": "shared"})
            condition = wait_for(
                lambda: (c := cluster.condition("cardio", "AdapterLoaded")) and c["reason"] == "LoadFailed" and c,
                timeout=60,
                message="the load failure",
            )
            assert condition["status"] == "False"
            lines = condition["message"].splitlines()
            assert lines[0] == "shared-0: loaded"
            assert lines[1].startswith("shared-1: load failed: HTTP 404")
            assert _models(good) == {"cardio@v1"}
            ms = _ms_status(cluster)
            assert ms["phase"] == "Degraded"
            (failure,) = next(p for p in ms["pods"] if p["pod"] == "shared-1")["failed"]
            assert failure["adapter"] == "cardio@v1"
            attempts = failure["attempts"]
            # retried with backoff: the attempts grow, slower than the timer ticks
            wait_for(lambda: _failure_attempts(cluster) > attempts, timeout=30, message="a retry")
    finally:
        good.stop()
        refusing.stop()


def _failure_attempts(cluster) -> int:
    pods = _ms_status(cluster).get("pods") or []
    return max((f["attempts"] for p in pods for f in p.get("failed") or []), default=0)


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_after_a_restart_each_replica_is_reconciled_both_ways(cluster, replicas, tiny_run, tiny_model_dir, tmp_path):
    root = tmp_path / "adapters"
    _model_server(cluster, str(tiny_model_dir), str(root))
    _pods(cluster, replicas)
    with running_operator(cluster):
        _train_and_export(cluster, "cardio", tiny_run, str(tiny_model_dir), {"server": "shared"})
        wait_for(lambda: _loaded_everywhere(cluster, "cardio"), timeout=60, message="loaded everywhere")
    # while the operator is down: replica 0 loses the adapter (a restart without the registry),
    # replica 1 holds a version nobody registered
    _unload(replicas[0], "cardio@v1")
    _load(replicas[1], "old@v3", str(root / "cardio" / "v1"))
    assert (_models(replicas[0]), _models(replicas[1])) == (set(), {"cardio@v1", "old@v3"})
    with running_operator(cluster):
        wait_for(lambda: all(_models(r) == {"cardio@v1"} for r in replicas), timeout=60, message="both fixed")


def _versions_answering(server: ServerProcess, alias: str, n: int) -> Counter[str]:
    """Which version answered each of `n` requests for the alias (the response's model field,
    and the version header beside it), sent 8 at a time as clients would."""
    from concurrent.futures import ThreadPoolExecutor

    def one(_: int) -> str:
        body = {"model": alias, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert response.status_code == 200, response.text
        assert response.headers["x-kubetune-adapter-version"] == response.json()["model"]
        return response.json()["model"]

    with ThreadPoolExecutor(8) as pool:
        return Counter(pool.map(one, range(n)))


def test_retuning_makes_a_new_version_beside_the_old_and_the_alias_routes_by_weight(
    cluster, replicas, tiny_run, tiny_model_dir, tmp_path
):
    root = tmp_path / "adapters"
    _model_server(cluster, str(tiny_model_dir), str(root))
    weights = {"cardio": {"v1": 10, "v2": 90}}
    meta = {"name": "shared", "namespace": NAMESPACE}
    cluster.client.patch({"apiVersion": MS[0], "kind": MS[1], "metadata": meta, "spec": {"weights": weights}})
    _pods(cluster, replicas)
    serve = {"server": "shared", "adapterName": "cardio"}
    with running_operator(cluster):
        for name in ("cardio-a", "cardio-b"):  # two tunings under one adapter name
            _train_and_export(cluster, name, tiny_run, str(tiny_model_dir), serve)
        served = wait_for(lambda: cluster.status("cardio-b").get("adapter"), message="the second version")
        assert served["servedName"] == "cardio@v2"
        both = {"cardio@v1", "cardio@v2"}
        wait_for(lambda: all(_models(r) >= both for r in replicas), timeout=60, message="both versions")
        assert sorted((root / "cardio").iterdir()) == [root / "cardio" / "v1", root / "cardio" / "v2"]
        # the 90/10 canary the ModelServer's weights set: over 300 requests on one replica, and on the other too
        for replica, requests in ((replicas[0], 300), (replicas[1], 30)):
            wait_for(lambda r=replica: _versions_answering(r, "cardio", 10)["cardio@v2"] > 0, 60, "the weights")
            counts = _versions_answering(replica, "cardio", requests)
            assert set(counts) == both and abs(counts["cardio@v1"] - requests // 10) <= max(2, requests // 30), counts
        # a weight of 0 rolls back
        rollback = {"cardio": {"v1": 100, "v2": 0}}
        cluster.client.patch({"apiVersion": MS[0], "kind": MS[1], "metadata": meta, "spec": {"weights": rollback}})
        for replica in replicas:
            wait_for(lambda r=replica: set(_versions_answering(r, "cardio", 20)) == {"cardio@v1"}, 60, "rollback")
