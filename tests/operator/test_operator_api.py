"""The operator (kopf) against an API server over HTTP: kmock's Kubernetes emulation on loopback.

conftest.py says what kmock lacks and how these tests stand in for it (uids, garbage
collection, the training operator, pod logs)."""

from __future__ import annotations

import base64
import http.server
import socketserver
import threading

import kopf
import pytest

from kubetune.contracts.progress_line import ProgressLine, format_line
from kubetune.k8s.names import TOKEN_KEY
from kubetune.kubeapi import ClusterError
from kubetune.operator import handlers

from .conftest import NAMESPACE, wait_for

RECIPE = {"train": {"max_steps": 40, "save_every": 10}, "k8s": {"replicas": 2, "amx_label": None}}
PYTORCHJOB = ("kubeflow.org/v1", "PyTorchJob")
JOB_KINDS = {"PyTorchJob"}


def _true(kind: str) -> dict:
    return {"type": kind, "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}


def _rank0_pod(
    cluster, job: str, log: str, restarts: int = 0, last_state: dict | None = None, metrics_port: int | None = None
) -> None:
    """The pod the training operator would start, with the log its rank 0 would print."""
    labels = {
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/component": "trainer",
        "training.kubeflow.org/replica-type": "master",
        "training.kubeflow.org/replica-index": "0",
    }
    status = {"restartCount": restarts, "name": "pytorch", "lastState": last_state or {}}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{job}-master-0", "namespace": NAMESPACE, "labels": labels},
        "spec": {"containers": [{"name": "pytorch", "image": "kubetune"}]},
        "status": {"phase": "Running", "containerStatuses": [status], "podIP": "127.0.0.1"},
    }
    if metrics_port is not None:  # as monitor.in_cluster renders it: a container port named `metrics`
        pod["spec"]["containers"][0]["ports"] = [{"name": "metrics", "containerPort": metrics_port}]
    if cluster.client.get("v1", "Pod", pod["metadata"]["name"], NAMESPACE) is None:
        cluster.client.create(pod)
    else:
        cluster.client.patch(pod)
    cluster.set_log(pod["metadata"]["name"], log)


def _progress_log(step: int, total: int, loss: float) -> str:
    line = ProgressLine(step=step, total=total, elapsed_s=60.0, remaining_s=120.0, s_per_it=2.0, loss=loss)
    return "kubetune: loading\n" + format_line(line) + "\n"


def test_create_makes_the_jobs_objects_owned_by_the_finetune(operator):
    ft = operator.apply_finetune("demo", {"recipe": RECIPE, "profile": "cpu"})
    uid = ft["metadata"]["uid"]
    job = wait_for(lambda: operator.get(*PYTORCHJOB, "demo"), message="the PyTorchJob")
    owned = operator.owned_by(uid)
    assert {"ConfigMap/demo-recipe", "Pod/demo-data", "PyTorchJob/demo"} <= set(owned)
    everything = sorted(f"{o['kind']}/{name}" for _, name, o in operator.live_objects() if o["kind"] != "FineTune")
    assert sorted(set(everything) - set(owned)) == ["PersistentVolumeClaim/demo-data"]  # Retain: the claim stays
    assert job["metadata"]["ownerReferences"] == [
        {"apiVersion": "kubetune.io/v1alpha1", "kind": "FineTune", "name": "demo", "uid": uid,
         "controller": True, "blockOwnerDeletion": True}
    ]  # fmt: skip
    volumes = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]
    assert {v["name"]: v.get("configMap", {}).get("name") for v in volumes}["recipe"] == "demo-recipe"
    status = wait_for(lambda: operator.status("demo").get("jobRef") and operator.status("demo"))
    assert status["phase"] == "Pending"
    assert status["jobRef"] == {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "demo"}
    assert status["artifacts"] == {
        "claim": "demo-data", "runDir": "/data/runs/demo", "adapter": "/data/runs/demo/adapter",
    }  # fmt: skip


def test_the_token_secret_is_copied_owned_and_referenced(operator):
    token = "hf_TESTtoken0123456789abcdefghijklmnopq"
    operator.client.create(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf", "namespace": NAMESPACE},
         "data": {"token": base64.b64encode(token.encode()).decode()}}
    )  # fmt: skip
    ft = operator.apply_finetune("gated", {"recipe": RECIPE, "hfTokenSecretRef": {"name": "hf", "key": "token"}})
    secret = wait_for(lambda: operator.get("v1", "Secret", "gated-hf-token"), message="the token Secret")
    assert base64.b64decode(secret["data"][TOKEN_KEY]).decode() == token
    assert secret["metadata"]["ownerReferences"][0]["uid"] == ft["metadata"]["uid"]
    job = wait_for(lambda: operator.get(*PYTORCHJOB, "gated"))
    env = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    ref = next(e["valueFrom"]["secretKeyRef"] for e in env if e["name"] == TOKEN_KEY)
    assert ref["name"] == "gated-hf-token"


def test_invalid_recipe_is_one_line_per_problem_and_creates_nothing(operator):
    recipe = {"train": {"max_stepz": 40}, "lora": {"r": 0}, "k8s": {"namespace": "elsewhere"}}
    operator.apply_finetune("bad", {"recipe": recipe})
    valid = wait_for(lambda: operator.condition("bad", "Valid"), message="the Valid condition")
    assert valid["status"] == "False" and valid["reason"] == "InvalidRecipe"
    assert valid["message"].splitlines() == [
        (
            "`k8s.namespace`: a FineTune's objects are named and placed by the FineTune ('kubetune', not "
            "'elsewhere'); remove the key"
        ),
        "`lora.r`: Input should be greater than or equal to 1 (got 0)",
        "unknown recipe key `train.max_stepz`: did you mean `train.max_steps`?",
    ]
    assert operator.status("bad")["phase"] == "Failed"
    assert [name for _, name, o in operator.live_objects() if o["kind"] != "FineTune"] == []
    # a fixed spec is created then (kopf does not retry the permanent error by itself); a merge
    # patch, as `kubectl patch --type merge` sends it: null removes a key
    fixed = {"train": {**RECIPE["train"], "max_stepz": None}, "lora": None, "k8s": {"namespace": None}}
    operator.edit_spec("bad", {"recipe": fixed})
    wait_for(lambda: operator.get(*PYTORCHJOB, "bad"), message="the job of the fixed FineTune")
    wait_for(lambda: operator.condition("bad", "Valid")["status"] == "True", message="Valid")


def test_progress_follows_the_job_and_restarts_get_a_diagnosis(operator):
    operator.apply_finetune("prog", {"recipe": RECIPE})
    wait_for(lambda: operator.get(*PYTORCHJOB, "prog"))
    operator.set_status(*PYTORCHJOB, "prog", {"conditions": [_true("Created"), _true("Running")]})
    _rank0_pod(operator, "prog", _progress_log(12, 40, 1.2345))
    progress = wait_for(lambda: operator.status("prog").get("progress"), message="status.progress")
    assert progress == {
        "step": 12, "totalSteps": 40, "percent": 30, "etaSeconds": 120, "eta": "2m", "loss": 1.2345,
    }  # fmt: skip
    assert operator.status("prog")["phase"] == "Running"
    oom = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
    _rank0_pod(operator, "prog", _progress_log(20, 40, 1.1), restarts=1, last_state=oom)
    restarted = wait_for(lambda: operator.condition("prog", "Restarted"), message="the Restarted condition")
    assert "OOMKilled" in restarted["message"] or "memory" in restarted["message"]
    assert wait_for(lambda: operator.status("prog").get("progress", {}).get("step") == 20)


def test_progress_comes_from_rank_0s_metrics_endpoint_when_it_serves_one(operator):
    """A real HTTP server on loopback plays the training pod's metrics port (the pod's IP is 127.0.0.1)."""
    page = "\n".join(
        f'{name}{{job="met",node="n0",rank="0"}} {value}'
        for name, value in [
            ("kubetune_train_step", 30), ("kubetune_train_total_steps", 40), ("kubetune_train_loss", 0.75),
            ("kubetune_train_eval_loss", 0.8), ("kubetune_train_eta_seconds", 61),
            ("kubetune_train_tokens_per_second", 512),
        ]
    ).encode()  # fmt: skip

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    with socketserver.TCPServer(("127.0.0.1", 0), Metrics) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        operator.apply_finetune("met", {"recipe": RECIPE})
        wait_for(lambda: operator.get(*PYTORCHJOB, "met"))
        operator.set_status(*PYTORCHJOB, "met", {"conditions": [_true("Created"), _true("Running")]})
        _rank0_pod(operator, "met", "no progress line in the log", metrics_port=server.server_address[1])
        progress = wait_for(lambda: operator.status("met").get("progress"), message="status.progress")
        server.shutdown()
    assert progress == {
        "step": 30, "totalSteps": 40, "percent": 75, "loss": 0.75, "evalLoss": 0.8, "tokensPerSecond": 512.0,
        "etaSeconds": 61, "eta": "1m1s",
    }  # fmt: skip


def test_a_failed_job_is_diagnosed_kept_failed_after_its_ttl_and_retried_by_suspend_and_resume(operator):
    operator.apply_finetune("oom", {"recipe": RECIPE, "ttlSecondsAfterFinished": 0})
    wait_for(lambda: operator.get(*PYTORCHJOB, "oom"))
    oom = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
    _rank0_pod(operator, "oom", "Killed", restarts=3, last_state=oom)
    failed = {**_true("Failed"), "reason": "BackoffLimitExceeded", "message": "the job has reached the backoff limit"}
    operator.set_status(*PYTORCHJOB, "oom", {"conditions": [_true("Created"), _true("Running"), failed]})
    condition = wait_for(lambda: operator.condition("oom", "Failed"), message="the Failed condition")
    assert "BackoffLimitExceeded" in condition["message"] and "OOMKilled" in condition["message"]
    assert operator.status("oom")["phase"] == "Failed"
    wait_for(lambda: operator.get(*PYTORCHJOB, "oom") is None, message="the job deleted after its TTL")
    assert operator.status("oom")["phase"] == "Failed"  # not recreated by itself
    operator.edit_spec("oom", {"suspend": True})
    wait_for(lambda: operator.status("oom").get("phase") == "Suspended")
    operator.edit_spec("oom", {"suspend": False})
    wait_for(lambda: operator.get(*PYTORCHJOB, "oom"), message="the job started again")


def test_suspend_deletes_the_job_keeps_the_volume_and_resume_recreates_it(operator):
    operator.apply_finetune("pause", {"recipe": RECIPE})
    wait_for(lambda: operator.get(*PYTORCHJOB, "pause"))
    operator.edit_spec("pause", {"suspend": True})
    wait_for(lambda: operator.get(*PYTORCHJOB, "pause") is None, message="the job deleted")
    wait_for(lambda: operator.status("pause").get("phase") == "Suspended")
    assert operator.get("v1", "PersistentVolumeClaim", "pause-data") is not None
    assert operator.get("v1", "ConfigMap", "pause-recipe") is not None
    operator.edit_spec("pause", {"suspend": False})
    job = wait_for(lambda: operator.get(*PYTORCHJOB, "pause"), message="the job recreated")
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"][:2] == [
        "kubetune",
        "train",
    ]  # the same recipe: train.resume=auto continues from the newest checkpoint on the claim
    wait_for(lambda: operator.status("pause").get("phase") == "Pending")


def test_recipe_edits_apply_only_when_the_run_stays_resumable(operator):
    operator.apply_finetune("edit", {"recipe": RECIPE})
    wait_for(lambda: operator.get(*PYTORCHJOB, "edit"))
    operator.edit_spec("edit", {"recipe": {**RECIPE, "train": {"max_steps": 80, "save_every": 10}}})
    change = wait_for(lambda: operator.condition("edit", "RecipeChange"), message="RecipeChange")
    assert change["status"] == "True" and "train.max_steps" in change["message"]
    assert "max_steps: 80" in operator.get("v1", "ConfigMap", "edit-recipe")["data"]["recipe.yaml"]
    operator.edit_spec("edit", {"recipe": {**RECIPE, "train": {"max_steps": 80, "save_every": 10, "lr": 0.1}}})
    wait_for(lambda: operator.condition("edit", "RecipeChange")["status"] == "False", message="the refusal")
    refused = operator.condition("edit", "RecipeChange")
    assert refused["reason"] == "NotResumable" and "train.lr" in refused["message"]
    assert "lr: 0.1" not in operator.get("v1", "ConfigMap", "edit-recipe")["data"]["recipe.yaml"]


def test_success_exports_serves_and_reports_the_endpoint_then_delete_removes_what_it_owns(operator):
    ft = operator.apply_finetune("full", {"recipe": RECIPE, "serve": {"enabled": True, "maxReplicas": 3}})
    wait_for(lambda: operator.get(*PYTORCHJOB, "full"))
    _rank0_pod(operator, "full", _progress_log(40, 40, 0.9))
    operator.set_status(*PYTORCHJOB, "full", {"conditions": [_true("Created"), _true("Running"), _true("Succeeded")]})
    export = wait_for(lambda: operator.get("batch/v1", "Job", "full-export"), message="the export Job")
    assert export["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "kubetune", "export", "/data/runs/full", "--merged",
    ]  # fmt: skip
    wait_for(lambda: operator.status("full").get("phase") == "Exporting")
    operator.set_status("batch/v1", "Job", "full-export", {"succeeded": 1})
    deployment = wait_for(lambda: operator.get("apps/v1", "Deployment", "full-serve"), message="the Deployment")
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == ft["metadata"]["uid"]
    wait_for(lambda: operator.status("full").get("phase") == "Serving")
    status = operator.status("full")
    assert status["endpoint"] == "http://full-serve.kubetune.svc:8000/v1"
    assert status["progress"]["percent"] == 100 and status["progress"]["eta"] == "done"
    assert status["artifacts"]["merged"] == "/data/runs/full/merged"
    assert operator.get("autoscaling/v2", "HorizontalPodAutoscaler", "full-serve")["spec"]["maxReplicas"] == 3

    operator.client.delete("kubetune.io/v1alpha1", "FineTune", "full", NAMESPACE)
    wait_for(lambda: operator.finetune("full") is None, message="kopf releasing its finalizer")
    gone = operator.collect_garbage()
    assert {"PyTorchJob/full", "Job/full-export", "Deployment/full-serve", "ConfigMap/full-recipe"} <= set(gone)
    left = sorted(f"{o['kind']}/{name}" for _, name, o in operator.live_objects())
    assert left == ["PersistentVolumeClaim/full-data", "Pod/full-master-0"]  # the claim is kept (Retain)


def test_volume_claim_retention_delete_makes_the_claim_owned(operator):
    ft = operator.apply_finetune("tmp", {"recipe": RECIPE, "volumeClaimRetention": "Delete"})
    claim = wait_for(lambda: operator.get("v1", "PersistentVolumeClaim", "tmp-data"))
    assert claim["metadata"]["ownerReferences"][0]["uid"] == ft["metadata"]["uid"]


# ------------------------------------------------------------------ errors, through the handler itself


def test_kubeflow_not_installed_is_a_temporary_error_and_conflicts_count_as_created(cluster):
    """The create handler, called as kopf calls it, against the emulated API: a 404 on the
    PyTorchJob API (the training operator's CRD not installed yet) is retried later; objects
    that exist already (409) are not an error."""
    import kmock

    client = cluster.client
    body = cluster.apply_finetune("early", {"recipe": RECIPE})
    # kmock's own 404 (the route of a resource the server does not serve); kmock still stores the object
    refused = cluster.kube.emulator[f"post /apis/kubeflow.org/v1/namespaces/{NAMESPACE}/pytorchjobs"]
    refused << kmock.KubernetesResourceNotFoundError()
    memo = kopf.Memo(client=client)
    with pytest.raises(kopf.TemporaryError, match="is the Kubeflow training operator"):
        handlers._created(body=kopf.Body(body), patch=kopf.Patch(), memo=memo)
    assert client.get("v1", "ConfigMap", "early-recipe", NAMESPACE) is not None  # made before the job: kept
    patch = kopf.Patch()
    handlers._created(body=kopf.Body(body), patch=patch, memo=memo)  # a retry: everything exists now (409s)
    assert patch.status["phase"] == "Pending"


def test_cluster_errors_become_temporary_errors():
    error = handlers._temporary(ClusterError("cannot reach the Kubernetes API at https://x: timeout"))
    assert isinstance(error, kopf.TemporaryError) and error.delay == handlers.RETRY_DELAY_S


def test_a_recipe_change_outlives_a_tick_that_started_from_an_older_body():
    """The timer writes status.conditions whole from the body it was given; a tick whose body
    predates the previous tick's patch must write the RecipeChange again, not drop it."""
    outcome = {
        "type": "RecipeChange",
        "status": "False",
        "reason": "NotResumable",
        "message": "m",
        "observedGeneration": 3,
    }
    memo = kopf.Memo(recipe_change=outcome)
    stale = {"metadata": {"name": "x"}, "status": {"conditions": [{"type": "Training", "status": "True"}]}}
    for _ in range(2):  # the tick that wrote it, then one that read an older body
        patch = kopf.Patch()
        handlers._write_recipe_change(stale, memo, patch)
        kinds = {c["type"]: c for c in patch.status["conditions"]}
        assert kinds["RecipeChange"]["reason"] == "NotResumable" and "Training" in kinds
    shown = {"metadata": {"name": "x"}, "status": {"conditions": [{**outcome, "lastTransitionTime": "t"}]}}
    patch = kopf.Patch()
    handlers._write_recipe_change(shown, memo, patch)
    assert "recipe_change" not in memo and not patch.status
