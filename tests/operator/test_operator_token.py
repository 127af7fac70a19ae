"""The Hugging Face token of a FineTune, in its status: a missing Secret is named in Valid=False
(phase Pending) and waited for, then the job is made; a gated model without spec.hfTokenSecretRef
is refused; serving reads the training job's token Secret. The real operator (kopf) against
kmock's API over HTTP (conftest.py says what kmock lacks and how these tests stand in for it)."""

from __future__ import annotations

import base64

from kubetune.k8s.names import TOKEN_KEY
from kubetune.operator import handlers

from .conftest import NAMESPACE, wait_for

RECIPE = {"train": {"max_steps": 40, "save_every": 10}, "k8s": {"replicas": 2, "amx_label": None}}
GATED = {**RECIPE, "model": {"name_or_path": "meta-llama/Llama-2-7b-chat-hf"}, "data": {"template": "llama2"}}
PYTORCHJOB = ("kubeflow.org/v1", "PyTorchJob")
TOKEN = "hf_TESTtoken0123456789abcdefghijklmnopq"


def _secret(name: str, key: str = "token") -> dict:
    data = {key: base64.b64encode(TOKEN.encode()).decode()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NAMESPACE}, "data": data}


def test_a_missing_token_secret_is_named_in_status_and_waited_for(operator, monkeypatch, caplog):
    monkeypatch.setattr(handlers, "TOKEN_RETRY_DELAY_S", 0.5)  # kopf's retries, shortened for the test
    monkeypatch.setattr(handlers, "TOKEN_RETRY_MAX_S", 1)
    operator.apply_finetune("waits", {"recipe": RECIPE, "hfTokenSecretRef": {"name": "hf", "key": "token"}})
    valid = wait_for(lambda: operator.condition("waits", "Valid"), message="the Valid condition")
    assert (valid["status"], valid["reason"]) == ("False", "TokenSecretMissing")
    assert valid["message"] == (
        f"spec.hfTokenSecretRef: Secret {NAMESPACE}/hf does not exist (yet); create it with "
        f"`kubectl create secret generic hf -n {NAMESPACE} --from-file=token=FILE` (the operator retries until then)"
    )
    assert operator.status("waits")["phase"] == "Pending"
    assert [name for _, name, o in operator.live_objects() if o["kind"] != "FineTune"] == []
    # the operator's log: kopf's one line per try, the same reason, no traceback
    tries = [r for r in caplog.records if "spec.hfTokenSecretRef" in r.getMessage()]
    assert tries and all(r.exc_info is None and "\n" not in r.getMessage() for r in tries)
    assert all(r.getMessage().endswith(valid["message"]) for r in tries)

    operator.client.create(_secret("hf"))
    job = wait_for(lambda: operator.get(*PYTORCHJOB, "waits"), message="the job, once the Secret exists")
    wait_for(lambda: operator.condition("waits", "Valid")["status"] == "True", message="Valid=True")
    # then it goes on as any FineTune: the timer follows the job (here a few seconds late: after
    # kopf's retries it sees kmock's unchanging resourceVersion as stale for a while)
    wait_for(lambda: operator.condition("waits", "Training"), message="the timer following the job")
    copy = operator.get("v1", "Secret", "waits-hf-token")
    assert base64.b64decode(copy["data"][TOKEN_KEY]).decode() == TOKEN
    env = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    assert next(e for e in env if e["name"] == TOKEN_KEY)["valueFrom"]["secretKeyRef"]["name"] == "waits-hf-token"


def test_a_secret_without_the_key_is_named_too(operator):
    operator.client.create(_secret("hf", key="other"))
    operator.apply_finetune("nokey", {"recipe": RECIPE, "hfTokenSecretRef": {"name": "hf", "key": "token"}})
    valid = wait_for(lambda: operator.condition("nokey", "Valid"), message="the Valid condition")
    assert (
        valid["reason"] == "TokenSecretMissing" and f"Secret {NAMESPACE}/hf has no key token (yet)" in valid["message"]
    )


def test_a_gated_model_without_a_token_secret_is_refused(operator):
    operator.apply_finetune("gated", {"recipe": GATED})
    valid = wait_for(lambda: operator.condition("gated", "Valid"), message="the Valid condition")
    assert (valid["status"], valid["reason"]) == ("False", "InvalidRecipe")
    assert "meta-llama/Llama-2-7b-chat-hf is gated" in valid["message"] and "hfTokenSecretRef" in valid["message"]
    assert operator.status("gated")["phase"] == "Failed"
    assert [name for _, name, o in operator.live_objects() if o["kind"] != "FineTune"] == []


def test_a_gated_models_pods_require_the_token_and_serving_reads_the_jobs_secret(operator):
    operator.client.create(_secret("hf"))
    spec = {"recipe": GATED, "hfTokenSecretRef": {"name": "hf", "key": "token"}, "serve": {"enabled": True}}
    operator.apply_finetune("llama", spec)
    job = wait_for(lambda: operator.get(*PYTORCHJOB, "llama"), message="the PyTorchJob")
    env = next(iter(job["spec"]["pytorchReplicaSpecs"].values()))["template"]["spec"]["containers"][0]["env"]
    ref = next(e for e in env if e["name"] == TOKEN_KEY)["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "llama-hf-token", "key": TOKEN_KEY, "optional": False}
    # training succeeds and the export Job completes, as the training operator and Job controller write it
    conditions = [{"type": kind, "status": "True"} for kind in ("Created", "Running", "Succeeded")]
    operator.set_status(*PYTORCHJOB, "llama", {"conditions": conditions})
    wait_for(lambda: operator.get("batch/v1", "Job", "llama-export"), message="the export Job")
    wait_for(lambda: operator.status("llama").get("phase") == "Exporting")
    operator.set_status("batch/v1", "Job", "llama-export", {"succeeded": 1})
    deployment = wait_for(lambda: operator.get("apps/v1", "Deployment", "llama-serve"), message="the Deployment")
    server = deployment["spec"]["template"]["spec"]["containers"][0]
    assert next(e for e in server["env"] if e["name"] == TOKEN_KEY)["valueFrom"]["secretKeyRef"]["name"] == (
        "llama-hf-token"
    )
    secrets = sorted(name for _, name, o in operator.live_objects() if o["kind"] == "Secret")
    assert secrets == ["hf", "llama-hf-token"]  # no second copy of the token for serving
