"""tests/k8s/test_contract.py's contract, started from what the operator created: the PyTorchJob and
ConfigMap the operator wrote to the (kmock) API server are run as real processes on loopback,
the way the training operator would run them; rank 0's log feeds the operator's status.progress;
then the export Job the operator creates is run the same way, and serving follows.

Stand-ins (besides conftest.py's): the training operator's job status is written by the test
when the processes exit; the rank-0 pod's log is the master process's stdout, served by kmock
as the pod's log as it grows; the export Job's container runs as a process with /data mapped to
the test's "claim" directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kubetune.k8s.finetune import recipe_data
from kubetune.netutil import free_port
from tests.k8s.test_contract import _replica_processes, _start
from tests.k8s.test_contract import pod_world as pod_world  # the fixture: a fake node with model and data

from .conftest import NAMESPACE, wait_for
from .test_operator_api import PYTORCHJOB, _rank0_pod, _true

# about 40 s on 2 cores: tests/operator/test_operator_api.py covers the same steps without processes
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _follow_log(cluster, pod: str, process: subprocess.Popen) -> threading.Thread:
    """Serve the process's output as the pod's log while it runs (what the kubelet keeps)."""

    def pump() -> None:
        text = ""
        for line in process.stdout:
            text += line
            cluster.set_log(pod, text)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def _run_export_job(job: dict, pvc, cwd) -> subprocess.CompletedProcess:
    container = job["spec"]["template"]["spec"]["containers"][0]
    command = [a.replace("/data", str(pvc)) for a in container["command"]]
    assert command[:2] == ["kubetune", "export"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBETUNE_")}
    env.update({e["name"]: e["value"].replace("/data", str(pvc)) for e in container["env"] if "value" in e})
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    argv = [sys.executable, "-m", "kubetune", *command[1:]]
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_operators_objects_train_export_and_serve(pod_world, operator):
    tmp_path, pvc, recipe = pod_world
    operator.apply_finetune("contract", {"recipe": recipe_data(recipe), "serve": {"enabled": True}})
    wait_for(lambda: operator.get(*PYTORCHJOB, "contract"), message="the PyTorchJob")
    made = [o for _, _, o in operator.live_objects() if o["kind"] in ("PyTorchJob", "ConfigMap")]
    procs = _replica_processes(tmp_path, pvc, recipe, [free_port(), free_port()], objects=made)
    assert len(procs) == 2

    pods = _start(procs, tmp_path)
    operator.set_status(*PYTORCHJOB, "contract", {"conditions": [_true("Created"), _true("Running")]})
    _rank0_pod(operator, "contract", "")
    pump = _follow_log(operator, "contract-master-0", pods[0])
    progress = wait_for(lambda: operator.status("contract").get("progress"), timeout=240, message="progress")
    assert progress["totalSteps"] == 8 and operator.status("contract")["phase"] == "Running"
    for pod in pods:
        assert pod.wait(timeout=300) == 0
    pump.join(10)
    wait_for(lambda: operator.status("contract").get("progress", {}).get("step") == 8, message="the last step")
    run = pvc / "runs" / "contract"
    assert json.loads((run / "summary.json").read_text())["steps"] == 8

    done = [_true("Created"), _true("Running"), _true("Succeeded")]
    operator.set_status(*PYTORCHJOB, "contract", {"conditions": done})
    export = wait_for(lambda: operator.get("batch/v1", "Job", "contract-export"), message="the export Job")
    result = _run_export_job(export, pvc, tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (run / "merged" / "config.json").is_file()
    assert operator.status("contract")["artifacts"]["merged"] == "/data/runs/contract/merged"

    operator.set_status("batch/v1", "Job", "contract-export", {"succeeded": 1})
    wait_for(lambda: operator.status("contract").get("phase") == "Serving", message="Serving")
    deployment = operator.get("apps/v1", "Deployment", "contract-serve")
    server = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "/data/runs/contract" in " ".join(server.get("command", []) + server.get("args", []))
    assert operator.status("contract")["endpoint"] == f"http://contract-serve.{NAMESPACE}.svc:8000/v1"
