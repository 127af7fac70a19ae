"""What `kubectl logs deploy/kubetune-operator` shows: the real `kubetune operator` process's output
while it handles a valid and an invalid FineTune against kmock's API over loopback HTTP.

conftest.py says what kmock lacks and how these tests stand in for it (here: the training operator
writing the job's status)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from .conftest import NAMESPACE, Cluster, wait_for

pytestmark = pytest.mark.process

RECIPE = {"train": {"max_steps": 40, "save_every": 10}, "k8s": {"replicas": 2, "amx_label": None}}
PYTORCHJOB = ("kubeflow.org/v1", "PyTorchJob")


class OperatorProcess:
    """`python -m kubetune pod operator` as a child process; its output read line by line as it comes."""

    def __init__(self, cluster: Cluster):
        argv = [sys.executable, "-m", "kubetune", "pod", "operator", "--namespace", NAMESPACE, "--interval", "0.25"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # $KUBECONFIG (the kube fixture's) names kmock
        self.process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, *words: str) -> list[str]:
        """The lines that contain every one of `words`."""
        return [line for line in self.lines if all(w in line for w in words)]

    def wait_said(self, *words: str, timeout: float = 15.0) -> str:
        return wait_for(lambda: self.said(*words), timeout, f"a line with {words} in:\n" + "\n".join(self.lines))[0]

    def stop(self) -> None:
        # killed, not interrupted: kopf's graceful exit waits up to 5 s for timers it spawns while
        # stopping, and how it exits is not what these tests read (every line is written as it happens)
        self.process.kill()
        self.process.wait(10)
        self._reader.join(5)


@pytest.fixture
def operator_process(cluster: Cluster) -> Iterator[OperatorProcess]:
    running = OperatorProcess(cluster)
    yield running
    running.stop()


def test_the_operator_logs_what_it_accepts_refuses_creates_and_concludes(cluster, operator_process):
    log = operator_process
    log.wait_said("kubetune.operator", "watching FineTunes in namespaces kubetune")
    cluster.apply_finetune("demo", {"recipe": RECIPE, "profile": "cpu"})
    cluster.apply_finetune("bad", {"recipe": {"train": {"max_stepz": 40}, "lora": {"r": 0}}})

    accepted = log.wait_said("[kubetune/demo] accepted")
    assert accepted.startswith("[20") and "[INFO" in accepted and "PyTorchJob demo, 2 replicas" in accepted
    log.wait_said("[kubetune/demo] created PyTorchJob/demo")  # the last object the handler creates
    for created in ("ConfigMap/demo-recipe", "PersistentVolumeClaim/demo-data", "PyTorchJob/demo"):
        assert len(log.said("[kubetune/demo] created " + created)) == 1, "\n".join(log.lines)
    # kopf's line for the permanent error; kopf may run the handler more than once for one
    # creation here (kmock's resourceVersion never changes), the operator's own lines stay single
    refused = log.wait_said("[kubetune/bad]", "refused, invalid recipe")
    assert "[ERROR" in refused
    assert (
        "`lora.r`: Input should be greater than or equal to 1 (got 0); unknown recipe key `train.max_stepz`" in refused
    )
    assert not log.said("[kubetune/bad] created") and not log.said("[kubetune/bad] accepted")
    assert len(log.said("[kubetune/demo] accepted")) == 1

    # the training operator's part: the job runs, a pod restarts; then the user suspends and resumes
    cluster.set_status(*PYTORCHJOB, "demo", {"conditions": [_true("Created"), _true("Running")]})
    assert "PyTorchJob demo is Running" in log.wait_said("[kubetune/demo] phase Pending -> Running")
    _rank0_pod(cluster, "demo", restarts=1)
    restarted = log.wait_said("[kubetune/demo] a training pod restarted (restarts: 1)")
    assert "[WARNING" in restarted and "kubetune k8s status demo -n kubetune" in restarted
    cluster.edit_spec("demo", {"suspend": True})
    log.wait_said("[kubetune/demo] deleted the job and its pods (spec.suspend); the volume claim stays")
    log.wait_said("[kubetune/demo] phase Running -> Suspended: spec.suspend is true")
    cluster.edit_spec("demo", {"suspend": False})
    wait_for(lambda: len(log.said("[kubetune/demo] created PyTorchJob/demo")) == 2, message="the job recreated")
    log.wait_said("[kubetune/demo] phase Suspended -> Pending: waiting for PyTorchJob demo to run")
    cluster.set_status(*PYTORCHJOB, "demo", {"conditions": [_true("Created"), _true("Running"), _true("Succeeded")]})
    done = log.wait_said("[kubetune/demo] phase Pending -> Succeeded")
    assert done.endswith("training succeeded; the model is in /data/runs/demo/adapter; concluded")
    wait_for(lambda: cluster.status("demo").get("phase") == "Succeeded")
    phases = log.said("[kubetune/demo] phase")
    assert len(phases) == 4, "one line per phase change:\n" + "\n".join(log.lines)
    assert len(log.said("[kubetune/demo] a training pod restarted")) == 1
    # kopf's per-handler lines ("Timer '_follow' succeeded." on every tick) stay out of the log
    assert not log.said("succeeded."), "\n".join(log.lines)


def test_the_operator_logs_a_recipe_edit_the_export_and_the_served_conclusion(cluster, operator_process):
    log = operator_process
    cluster.apply_finetune("full", {"recipe": RECIPE, "serve": {"enabled": True}})
    log.wait_said("[kubetune/full] created PyTorchJob/full")
    cluster.edit_spec("full", {"recipe": {**RECIPE, "train": {"max_steps": 80, "save_every": 10}}})
    assert "train.max_steps: the training pods read it" in log.wait_said("[kubetune/full] recipe edit: applied")
    cluster.edit_spec("full", {"recipe": {**RECIPE, "train": {"max_steps": 80, "save_every": 10, "lr": 0.1}}})
    refused = log.wait_said("[kubetune/full] recipe edit: not applied")
    assert "[WARNING" in refused and "changing train.lr changes what is learned" in refused

    cluster.set_status(*PYTORCHJOB, "full", {"conditions": [_true("Created"), _true("Running"), _true("Succeeded")]})
    log.wait_said("[kubetune/full] created Job/full-export")
    exporting = log.wait_said("[kubetune/full] phase Pending -> Exporting")
    assert exporting.endswith("training succeeded; Job full-export merges the adapter into the model")
    cluster.set_status("batch/v1", "Job", "full-export", {"succeeded": 1})
    log.wait_said("[kubetune/full] created Deployment/full-serve")
    log.wait_said("[kubetune/full] the OpenAI endpoint is http://full-serve.kubetune.svc:8000/v1")
    served = log.wait_said("[kubetune/full] phase Exporting -> Serving")
    assert served.endswith("Deployment full-serve serves the model; concluded")
    assert len(log.said("[kubetune/full] recipe edit:")) == 2 and len(log.said("[kubetune/full] phase")) == 2


def _rank0_pod(cluster: Cluster, job: str, restarts: int) -> None:
    """The training operator's rank-0 pod, as far as the restart count goes (its log says nothing)."""
    labels = {
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/component": "trainer",
        "training.kubeflow.org/replica-type": "master",
        "training.kubeflow.org/replica-index": "0",
    }
    cluster.client.create(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{job}-master-0", "namespace": NAMESPACE,
         "labels": labels}, "spec": {"containers": [{"name": "pytorch", "image": "kubetune"}]},
         "status": {"phase": "Running", "containerStatuses": [{"name": "pytorch", "restartCount": restarts}]}}
    )  # fmt: skip
    cluster.set_log(f"{job}-master-0", "")


def _true(kind: str) -> dict:
    return {"type": kind, "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
