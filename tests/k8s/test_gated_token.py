"""A gated model's Hugging Face token, named before submission and after: `submit` and
`render --check` refuse a gated model without a token source, the pods require the token's
Secret, serving reads the training job's Secret, and `doctor` reads the Hub's refusal in the
pods' logs.

The pods' log in the doctor test is what `kubetune train` really prints when the Hub refuses
it: the real process, through huggingface_hub and transformers, against a loopback HTTP
server that answers as huggingface.co answers a gated repository (401 without a token,
403 with one not granted access, `X-Error-Code: GatedRepo`; huggingface_hub's
`hf_raise_for_status` reads that header)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from kubetune.k8s import render as r
from kubetune.k8s.doctor import Snapshot, diagnose
from kubetune.k8s.serve import ServeSettings
from kubetune.k8s.serve.render import render_serve
from kubetune.recipe.gated import known_gated, needs_token
from kubetune.recipe.loader import load_recipe
from kubetune.rundir import fingerprint

from .conftest import TOKEN

pytestmark = pytest.mark.process

SEED = "llama2-7b-medical-flashcards"  # meta-llama/Llama-2-7b-chat-hf: gated
MODEL = "meta-llama/Llama-2-7b-chat-hf"
SMOL = "smollm2-135m-lora-cpu"  # the embedded default: no token
NS = "kubetune"


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "hf-token"
    path.write_text(TOKEN + "\n")
    return path


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("kubetune: error:")]


def _token_env(container: dict) -> dict:
    return next(e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "HF_TOKEN")


# ------------------------------------------------------------------ which models need a token


@pytest.mark.parametrize(
    ("name", "gated"),
    [
        ("meta-llama/Llama-2-7b-chat-hf", True),
        ("meta-llama/Meta-Llama-3-8B-Instruct", True),
        ("google/gemma-2b", True),
        ("mistralai/Mistral-7B-Instruct-v0.2", True),
        ("mistralai/Mixtral-8x7B-v0.1", True),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", False),
        ("smollm2-135m-instruct", False),
        ("/data/models/llama", False),
    ],
)
def test_known_gated_ids(name, gated):
    assert known_gated(name) is gated


def test_model_gated_overrides_the_table():
    assert needs_token(load_recipe(SEED, []).recipe)
    assert not needs_token(load_recipe(SEED, ["model.gated=false"]).recipe)
    assert needs_token(load_recipe(SMOL, ["model.gated=true"]).recipe)
    assert not needs_token(load_recipe(SMOL, []).recipe)


def test_model_gated_is_not_part_of_a_runs_fingerprint():
    """Whether the pods need a token is not what they learn: a run recorded before model.gated
    existed, or with another value of it, stays resumable."""
    fingerprints = {fingerprint(load_recipe(SEED, [f"model.gated={v}"]).recipe) for v in ("null", "true", "false")}
    assert len(fingerprints) == 1


# ------------------------------------------------------------------ refused without a token source


def test_render_check_of_a_gated_recipe_without_a_token_is_one_line_naming_both_sources(cli):
    result = cli("k8s", "render", SEED, "--check")
    assert result.code == 2, result.err
    (error,) = _errors(result.err)
    assert result.err.count("\n") == 1, result.err
    assert MODEL in error and "--hf-token-file" in error and "hfTokenSecretRef" in error
    assert "model.gated=false" in error
    assert result.out == ""


def test_render_check_with_a_token_or_a_public_model_passes(cli, token_file, monkeypatch):
    assert cli("k8s", "render", SEED, "--check", "--hf-token-file", str(token_file)).code == 0
    assert cli("k8s", "render", SEED, "--check", "model.gated=false").code == 0
    assert cli("k8s", "render", SMOL, "--check").code == 0
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert cli("k8s", "render", SEED, "--check").code == 0


def test_plain_render_of_a_gated_recipe_without_a_token_warns_and_renders(cli):
    result = cli("k8s", "render", SEED)
    assert result.code == 0, result.err
    assert f"warning: model.name_or_path={MODEL} is gated" in result.err
    assert f"Secret {SEED}-hf-token" in result.err


def test_submit_of_a_gated_recipe_without_a_token_is_refused_before_anything_is_sent(cli, kube):
    result = cli("k8s", "submit", SEED)
    assert result.code == 2, result.err
    (error,) = _errors(result.err)
    assert "--hf-token-file" in error and "hfTokenSecretRef" in error
    assert kube.objects("kubeflow.org/v1/pytorchjobs") == {} and kube.objects("v1/configmaps") == {}
    via_operator = cli("k8s", "submit", SEED, "--via-operator")
    assert via_operator.code == 2 and len(_errors(via_operator.err)) == 1
    assert "hfTokenSecretRef" in via_operator.err


def test_submit_of_a_gated_recipe_with_a_token_creates_its_secret(cli, kube, token_file):
    result = cli("k8s", "submit", SEED, "--hf-token-file", str(token_file))
    assert result.code == 0, result.err
    assert (NS, f"{SEED}-hf-token") in kube.objects("v1/secrets")
    assert "no Hugging Face token" not in result.err


# ------------------------------------------------------------------ the pods' token reference


def test_the_pods_of_a_gated_model_require_the_token_secret():
    job = r.render(load_recipe(SEED, []).recipe, hf_token=TOKEN).job
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        ref = _token_env(spec["template"]["spec"]["containers"][0])
        assert ref == {"name": f"{SEED}-hf-token", "key": "HF_TOKEN", "optional": False}


def test_the_pods_of_a_public_model_start_without_the_secret():
    job = r.render(load_recipe(SMOL, []).recipe).job
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        assert _token_env(spec["template"]["spec"]["containers"][0])["optional"] is True


# ------------------------------------------------------------------ serving reads the job's Secret


def _server(objects: list[dict]) -> dict:
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("engine", ["native", "vllm"])
def test_serving_reads_the_training_jobs_token_secret(engine):
    recipe = load_recipe(SEED, []).recipe
    training = r.render(recipe, hf_token=TOKEN)
    (job_secret,) = [o for o in training.objects if o["kind"] == "Secret"]
    served = render_serve(recipe, ServeSettings(engine=engine))
    assert [o for o in served.objects if o["kind"] == "Secret"] == []  # the job's Secret is there already
    ref = _token_env(_server(served.objects))
    assert ref["name"] == job_secret["metadata"]["name"] == f"{SEED}-hf-token"


def test_serving_with_a_token_renders_the_jobs_secret_not_a_second_one():
    served = render_serve(load_recipe(SMOL, []).recipe, ServeSettings(), hf_token=TOKEN)
    (secret,) = [o for o in served.objects if o["kind"] == "Secret"]
    assert secret["metadata"]["name"] == f"{SMOL}-hf-token"
    assert _token_env(_server(served.objects))["name"] == f"{SMOL}-hf-token"


# ------------------------------------------------------------------ doctor reads the Hub's refusal


class _GatedHub(http.server.BaseHTTPRequestHandler):
    """huggingface.co for one gated repository: its model info is public (200), its files answer
    401 without a token and 403 with a token not granted access, with the headers
    huggingface_hub reads (`X-Error-Code: GatedRepo`, `X-Error-Message`)."""

    def _answer(self) -> None:
        if self.path.startswith(f"/api/models/{MODEL}"):
            body = json.dumps({"id": MODEL, "gated": "manual", "private": False}).encode()
            self._send(200, body, {"Content-Type": "application/json"})
        elif self.path.startswith(f"/{MODEL}/resolve/"):
            authorized = bool(self.headers.get("authorization"))
            message = (
                f"Access to model {MODEL} is restricted and you are not in the authorized list. "
                f"Visit https://huggingface.co/{MODEL} to ask for access."
                if authorized
                else f"Access to model {MODEL} is restricted. You must have access to it and be authenticated "
                "to access it. Please log in."
            )
            self._send(403 if authorized else 401, b"", {"X-Error-Code": "GatedRepo", "X-Error-Message": message})
        else:
            self._send(404, b"", {})

    def _send(self, code: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(code)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    do_GET = do_HEAD = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def refused_train_log(tmp_path_factory) -> Iterator[str]:
    """What a training pod of the gated recipe prints when the Hub refuses it (no token)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _GatedHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tmp = tmp_path_factory.mktemp("gated")
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env.update(
        HF_HUB_OFFLINE="0",
        HF_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}",
        HF_HOME=str(tmp / "hf"),
        KUBETUNE_CACHE=str(tmp / "cache"),
    )
    argv = [sys.executable, "-m", "kubetune", "train", SEED, f"output_dir={tmp / 'run'}", "train.max_steps=1"]
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=tmp)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 2, done.stdout + done.stderr
    yield done.stdout + done.stderr


def _crash_looping_master(job: str) -> dict:
    labels = {
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/component": "trainer",
        "training.kubeflow.org/replica-type": "worker",
        "training.kubeflow.org/replica-index": "0",
    }
    status = {
        "name": "pytorch",
        "restartCount": 4,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"reason": "Error", "exitCode": 2}},
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{job}-worker-0", "namespace": NS, "labels": labels},
        "spec": {"containers": [{"name": "pytorch", "image": "img"}], "nodeName": "node-a"},
        "status": {"phase": "Running", "containerStatuses": [status]},
    }


def test_doctor_names_the_token_when_the_hub_refuses_the_pods(cli, kube, token_file, refused_train_log):
    assert cli("k8s", "submit", SEED, "--hf-token-file", str(token_file)).code == 0
    kube.client().create(_crash_looping_master(SEED))
    kube.script_log(f"{SEED}-worker-0", "kubetune: processes: 1\n" + refused_train_log)
    result = cli("k8s", "doctor", SEED)
    assert result.code == 1, result.out
    lines = result.out.splitlines()
    found = [i for i, line in enumerate(lines) if "Hugging Face token" in line]
    assert len(found) == 1, result.out
    line = lines[found[0]]
    assert line.startswith(
        f"[error] pod {SEED}-worker-0: the Hugging Face token is missing or has no access to {MODEL}"
    )
    fix = lines[found[0] + 1]
    assert "--hf-token-file" in fix and f"Secret {SEED}-hf-token" in fix and f"https://huggingface.co/{MODEL}" in fix
    assert "CrashLoopBackOff" not in result.out  # the token explains the crash loop


@pytest.mark.parametrize(
    "line",
    [
        "huggingface_hub.errors.GatedRepoError: 403 Client Error. (Request ID: Root=1-abc)",
        "requests.exceptions.HTTPError: 401 Client Error: Unauthorized for url: https://huggingface.co/api/models/x",
        f"OSError: {MODEL} is a gated repository. Make sure to request access at https://huggingface.co/{MODEL}",
    ],
)
def test_doctor_reads_the_hubs_401_403_and_gated_errors(line):
    recipe = {"model": {"name_or_path": MODEL}}
    pod = _crash_looping_master("run")
    snap = Snapshot(name="run", namespace=NS, job=None, pods=[pod], logs={"run-worker-0": [line]}, recipe=recipe)
    found = [f for f in diagnose(snap) if "Hugging Face token" in f.problem]
    assert len(found) == 1 and found[0].severity == "error"
    assert f"no access to {MODEL}" in found[0].problem
