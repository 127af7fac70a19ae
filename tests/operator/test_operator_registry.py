"""spec.export.register: the export Job registers the model after the eval gate, and the operator
shows what was registered in status.registered (issue 38).

The render and the spec's checks are tested as they are. The operator's side runs against kmock
(tests/operator/conftest.py) with the export Job's container REALLY run here, as the kubelet
would run it: its command with /data mapped to a "claim" directory holding a tiny trained run,
its env, its envFrom read from the Secret in the (kmock) API server, and its termination
message file at KUBETUNE_TERMINATION_LOG; that file's text becomes the export pod's terminated
message. MLflow is a real `mlflow server` (tests/kit/trackers.py), asked back with its own
client; Kubeflow's Model Registry (no server can run here) refuses through its real client.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kubetune.contracts.gate import (
    gate_message,
    read_gate_message,
    read_lm_eval_message,
    read_register_error_message,
    read_registered_message,
)
from kubetune.errors import RecipeError
from kubetune.k8s.export_job import Register, adapter_install_command, export_command, export_job
from kubetune.k8s.names import Names
from kubetune.netutil import free_port
from kubetune.operator.plan import FineTuneSpec, load_recipe_for
from kubetune.recipe import load_recipe
from kubetune.rundir import RunDir, fingerprint
from kubetune.training.run import train_from_recipe

from ..conftest import tiny_recipe, write_qa_file
from .conftest import NAMESPACE, wait_for
from .test_operator_api import PYTORCHJOB, _progress_log, _rank0_pod, _true

SRC = Path(__file__).resolve().parents[2] / "src"
TRACKING = {"secret": "mlflow-env"}
PASSING = {"metric": "eval_loss", "tolerance": 100.0}  # the tuned loss within 100 of the base's
FAILING = {"metric": "eval_loss", "compare": "threshold", "threshold": 0.0}  # no loss is <= 0
RECIPE = {
    "train": {"max_steps": 40, "save_every": 10},
    "k8s": {"replicas": 2, "amx_label": None},
    "eval": {"gate": PASSING},
    "monitor": {"tracking_env_from": TRACKING},
}


# ------------------------------------------------------------------ the render and the spec


def _recipe(*overrides: str):
    return load_recipe(None, ["monitor.tracking_env_from.secret=mlflow-env", *overrides]).recipe


def test_the_export_job_registers_after_the_gate_with_the_trackers_env():
    recipe = _recipe("eval.gate={metric: eval_loss}")
    spec = FineTuneSpec.from_dict({"export": {"merged": True, "register": "mlflow", "registeredName": "cards"}})
    command = export_command(recipe, merged=spec.merges(), register=spec.register)
    assert command == ["kubetune", "export", recipe.output_dir, "--merged", "--gate",
                       "--register", "mlflow", "--registered-name", "cards"]  # fmt: skip
    job = export_job(recipe, Names.for_job("ft", "team"), "ft-export", command, tracking=True)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == command
    assert container["envFrom"] == [{"secretRef": {"name": "mlflow-env"}}]
    plain = export_job(recipe, Names.for_job("ft", "team"), "ft-export")["spec"]["template"]["spec"]
    assert "envFrom" not in plain["containers"][0]  # a Job that does not register gets no tracker settings


def test_a_run_to_register_gets_an_export_job_that_exports_the_adapter_as_it_is():
    recipe = _recipe()
    spec = FineTuneSpec.from_dict({"export": {"register": "kubeflow", "registryUrl": "http://mr:8080"}})
    assert spec.export_wanted(recipe) and not spec.merges()
    assert export_command(recipe, merged=spec.merges(), register=spec.register) == [
        "kubetune", "export", recipe.output_dir, "--register", "kubeflow", "--registry-url", "http://mr:8080"
    ]  # fmt: skip
    full = _recipe("finetune.method=full")
    assert FineTuneSpec.from_dict({"export": {"register": "mlflow"}}).export_wanted(full)  # registers model/
    assert not FineTuneSpec.from_dict({}).export_wanted(full)


def test_a_shared_servers_adapter_export_registers_it():
    recipe = _recipe("eval.gate={metric: perplexity}")
    spec = FineTuneSpec.from_dict({"serve": {"enabled": True, "server": "shared"}, "export": {"register": "mlflow"}})
    assert not spec.export_wanted(recipe)  # no merged Job: the adapter-export Job registers
    command = adapter_install_command(recipe, "cardio", "v1", "org/base", None, register=spec.register)
    assert command[-3:] == ["--gate", "--register", "mlflow"]  # the gate first: a failed one is never registered


@pytest.mark.parametrize(
    ("export", "recipe", "problem"),
    [
        ({"register": "sagemaker"}, RECIPE, "spec.export.register: 'sagemaker' is not a registry kubetune knows"),
        ({"register": "kubeflow"}, RECIPE, "spec.export.registryUrl: register kubeflow needs"),
        ({"register": "mlflow", "registryUrl": "http://x"}, RECIPE, "spec.export.registryUrl: goes with register kube"),
        ({"registeredName": "x"}, RECIPE, "spec.export.registeredName and registryUrl go with spec.export.register"),
        (
            {"register": "mlflow"},
            {},
            "spec.export.register: mlflow reads MLFLOW_TRACKING_URI from the recipe's monitor",
        ),
    ],
)
def test_a_registry_that_cannot_work_is_refused_in_one_line_naming_the_key(export, recipe, problem):
    spec = FineTuneSpec.from_dict({"recipe": recipe, "export": export})
    with pytest.raises(RecipeError) as e:
        load_recipe_for("ft", "team", recipe, spec)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(problem), e.value.problems


def test_what_was_registered_fits_the_message_beside_the_verdict():
    verdict = {"metric": "eval_loss", "passed": True, "base": 2.0, "tuned": 1.5, "rule": "tuned <= base"}
    huge = {f"task_{i}": {"acc": {"base": 0.123456789, "tuned": 0.5}} for i in range(200)}
    registered = {"registry": "mlflow", "name": "cards", "version": "3", "uri": "mlflow-artifacts:/" + "x" * 5000}
    message = gate_message(verdict, huge, registered)
    assert len(message.encode()) <= 4096
    assert read_gate_message(message)["passed"] is True and read_lm_eval_message(message) is None
    found = read_registered_message(message)
    assert found is not None and found["name"] == "cards" and found["version"] == "3"
    assert found["uri"].startswith("mlflow-artifacts:/xxx") and found["uri"].endswith("...")
    refused = gate_message(verdict, None, register_error="--register kubeflow: http://mr refused the model (503)")
    assert read_register_error_message(refused) == "--register kubeflow: http://mr refused the model (503)"
    assert read_registered_message(refused) is None and read_registered_message(gate_message(verdict)) is None


# ------------------------------------------------------------------ the operator, the Job run for real


@pytest.fixture(scope="module")
def claim(tmp_path_factory, tiny_model_dir) -> Path:
    """The volume claim's /data: runs/tiny (its gate passes) and runs/worse (its gate fails),
    each a finished tiny LoRA run, as training on the cluster leaves them."""
    root = tmp_path_factory.mktemp("claim")
    overrides = tiny_recipe(tiny_model_dir, write_qa_file(root / "qa.jsonl"), root / "cache")
    for name, gate in (("tiny", PASSING), ("worse", FAILING)):
        run = root / "runs" / name
        train_from_recipe(None, [*overrides, f"output_dir={run}", "train.max_steps=2", "eval.generate=0",
                                 f"eval.gate={json.dumps(gate)}"])  # fmt: skip
    return root


def _trained(operator, name: str, spec: dict) -> dict:
    """The FineTune trained (as the training operator would say); its export Job, once created."""
    operator.apply_finetune(name, spec)
    wait_for(lambda: operator.get(*PYTORCHJOB, name), message="the PyTorchJob")
    _rank0_pod(operator, name, _progress_log(40, 40, 0.9))
    operator.set_status(*PYTORCHJOB, name, {"conditions": [_true("Created"), _true("Running"), _true("Succeeded")]})
    return wait_for(lambda: operator.get("batch/v1", "Job", f"{name}-export"), message="the export Job")


def _kubelet_env(operator, container: dict, claim: Path) -> dict[str, str]:
    """The container's environment as the kubelet makes it: env values, then every key of each
    envFrom Secret / ConfigMap as the API server holds it."""
    env = {e["name"]: e["value"].replace("/data", str(claim)) for e in container.get("env", []) if "value" in e}
    for source in container.get("envFrom", []):
        if "secretRef" in source:
            secret = operator.get("v1", "Secret", source["secretRef"]["name"]) or {}
            env.update({k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()})
        else:
            config_map = operator.get("v1", "ConfigMap", source["configMapRef"]["name"]) or {}
            env.update(config_map.get("data") or {})
    return env


def _run_job(operator, job: dict, claim: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, str]:
    """The export Job's container run here: its exit, and its termination message."""
    container = job["spec"]["template"]["spec"]["containers"][0]
    command = [a.replace("/data", str(claim)) for a in container["command"]]
    assert command[:2] == ["kubetune", "export"]
    log = tmp_path / "termination-log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBETUNE_", "MLFLOW_"))}
    env.update(_kubelet_env(operator, container, claim), PYTHONPATH=str(SRC), KUBETUNE_TERMINATION_LOG=str(log))
    argv = [sys.executable, "-m", "kubetune", *command[1:]]
    result = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    return result, log.read_text() if log.is_file() else ""


def _export_pod(operator, job: str, result: subprocess.CompletedProcess, message: str) -> None:
    """The export pod, ended as the process did, with its termination message; the Job's status."""
    terminated = {"exitCode": result.returncode, "reason": "Completed" if result.returncode == 0 else "Error"}
    phase = "Succeeded" if result.returncode == 0 else "Failed"
    pod = {"name": f"{job}-abcde", "namespace": NAMESPACE, "labels": {"job-name": job}}
    operator.client.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": pod,
            "spec": {"containers": [{"name": "export", "image": "kubetune"}]},
            "status": {
                "phase": phase,
                "containerStatuses": [{"name": "export", "state": {"terminated": {**terminated, "message": message}}}],
            },
        }
    )
    failed = {"conditions": [{**_true("Failed"), "reason": "BackoffLimitExceeded"}], "failed": 3}
    operator.set_status("batch/v1", "Job", job, {"succeeded": 1} if phase == "Succeeded" else failed)


def _mlflow_secret(operator, uri: str) -> None:
    data = {"MLFLOW_TRACKING_URI": base64.b64encode(uri.encode()).decode()}
    meta = {"name": TRACKING["secret"], "namespace": NAMESPACE}
    operator.client.create({"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": data})


@pytest.mark.process  # the export Job's command runs as a process
def test_the_operator_registers_the_adapter_in_mlflow(operator, claim, mlflow_tracking_server, tmp_path):
    from mlflow import MlflowClient

    _mlflow_secret(operator, mlflow_tracking_server.uri)
    spec = {"recipe": RECIPE, "export": {"register": "mlflow", "registeredName": "tiny-cards"}}  # merging: unit-tested
    job = _trained(operator, "tiny", spec)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"] == [{"secretRef": {"name": "mlflow-env"}}]
    result, message = _run_job(operator, job, claim, tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    _export_pod(operator, "tiny-export", result, message)

    registered = wait_for(lambda: operator.status("tiny").get("registered"), message="status.registered")
    client = MlflowClient(mlflow_tracking_server.uri)
    latest = max(client.search_model_versions("name='tiny-cards'"), key=lambda v: int(v.version))
    expected = {"registry": "mlflow", "name": "tiny-cards", "version": str(latest.version), "uri": latest.source}
    assert registered == expected
    assert latest.tags["kubetune.weights"] == "adapter"
    assert latest.tags["kubetune.recipe_hash"] == fingerprint(RunDir(claim / "runs" / "tiny").recipe())
    wait_for(lambda: operator.status("tiny").get("phase") == "Succeeded", message="Succeeded")
    condition = operator.condition("tiny", "Registered")
    assert condition["status"] == "True" and f"tiny-cards version {latest.version} in mlflow" in condition["message"]


@pytest.mark.process  # the export Job's command runs as a process
def test_a_run_whose_gate_failed_is_never_registered(operator, claim, mlflow_tracking_server, tmp_path):
    from mlflow import MlflowClient

    _mlflow_secret(operator, mlflow_tracking_server.uri)
    recipe = {**RECIPE, "eval": {"gate": FAILING}}
    job = _trained(operator, "worse", {"recipe": recipe, "export": {"register": "mlflow", "registeredName": "worse"}})
    result, message = _run_job(operator, job, claim, tmp_path)
    assert result.returncode == 0 and "not exported: the eval gate failed" in result.stdout, result.stderr[-3000:]
    assert read_gate_message(message)["passed"] is False and read_registered_message(message) is None
    _export_pod(operator, "worse-export", result, message)

    wait_for(lambda: (operator.condition("worse", "Registered") or {}).get("reason") == "GateFailed")
    assert "not registered: the eval gate failed" in operator.condition("worse", "Registered")["message"]
    # the condition and the phase are separate status writes: wait for the phase, then read both
    wait_for(lambda: operator.status("worse")["phase"] == "Succeeded")
    assert "registered" not in operator.status("worse")
    assert MlflowClient(mlflow_tracking_server.uri).search_registered_models("name='worse'") == []


@pytest.mark.process  # the export Job's command runs as a process
def test_a_refused_registration_fails_the_finetune_naming_why(operator, claim, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the Model Registry's client is refused
    recipe = {k: v for k, v in RECIPE.items() if k != "monitor"}  # Kubeflow's registry needs no tracker settings
    job = _trained(operator, "tiny", {"recipe": recipe, "export": {"register": "kubeflow", "registryUrl": url}})
    assert "envFrom" not in job["spec"]["template"]["spec"]["containers"][0]
    result, message = _run_job(operator, job, claim, tmp_path)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"--register kubeflow: {url} refused the model" in read_register_error_message(message)
    _export_pod(operator, "tiny-export", result, message)

    wait_for(lambda: operator.status("tiny").get("phase") == "Failed", message="Failed")
    failed = operator.condition("tiny", "Failed")
    assert failed["reason"] == "RegistrationFailed" and f"{url} refused the model" in failed["message"]
    assert operator.condition("tiny", "Registered")["reason"] == "RegistrationFailed"
    assert "registered" not in operator.status("tiny")


@pytest.mark.process  # the adapter-export Job's command runs as a process
def test_a_shared_servers_adapter_export_registers_the_adapter_it_installed(claim, mlflow_tracking_server, tmp_path):
    """spec.serve.server: the adapter-export Job's command, as rendered, installs the adapter and
    then registers that copy under the adapter's name (no --registered-name)."""
    from mlflow import MlflowClient

    run = claim / "runs" / "tiny"
    recipe = RunDir(run).recipe()
    root = tmp_path / "adapters"
    command = adapter_install_command(recipe, "cards", "v1", "org/base", None, str(root), register=Register("mlflow"))
    log = tmp_path / "termination-log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBETUNE_", "MLFLOW_"))}
    env.update(PYTHONPATH=str(SRC), KUBETUNE_TERMINATION_LOG=str(log), MLFLOW_TRACKING_URI=mlflow_tracking_server.uri)
    result = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert (root / "cards" / "v1" / "adapter_config.json").is_file()
    registered = read_registered_message(log.read_text())
    versions = MlflowClient(mlflow_tracking_server.uri).search_model_versions("name='cards'")
    latest = max(versions, key=lambda v: int(v.version))
    assert registered == {"registry": "mlflow", "name": "cards", "version": str(latest.version), "uri": latest.source}
    assert read_gate_message(log.read_text())["passed"] is True  # the gate checked first, as before
