"""`kubetune k8s submit --via-operator`, `kubetune k8s status NAME` on a FineTune, `kubetune operator`'s
own errors: the CLI in-process against kmock over HTTP (the operator itself is not running here)."""

from __future__ import annotations

import base64

from kubetune.k8s.names import TOKEN_KEY
from kubetune.operator.crd import API_VERSION, KIND, check_finetune
from tests.k8s.conftest import TOKEN
from tests.kit.cli import run_cli_redirected

from .conftest import NAMESPACE

RECIPE_ARGS = ["smollm2-135m-lora-cpu", "train.max_steps=20", "k8s.amx_label=null"]


def test_submit_via_operator_creates_a_valid_finetune_and_its_owned_token(cluster, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    serve = ["--serve", "--engine", "vllm", "--max-replicas", "3"]
    result = run_cli_redirected(
        "k8s", "submit", *RECIPE_ARGS, "--via-operator", "--hf-token-file", str(token_file), *serve
    )
    assert result.code == 0, result.err
    name = "smollm2-135m-lora-cpu"
    ft = cluster.client.get(API_VERSION, KIND, name, NAMESPACE)
    assert check_finetune(ft) == []  # what the API server's schema accepts
    spec = ft["spec"]
    assert spec["recipe"]["train"]["max_steps"] == 20 and spec["recipe"]["lora"]["target_modules"] == "all-linear"
    assert "name" not in spec["recipe"].get("k8s", {}) and spec["profile"] == "cpu"
    assert spec["serve"] == {"enabled": True, "engine": "vllm", "maxReplicas": 3}
    assert spec["hfTokenSecretRef"] == {"name": f"{name}-hf-token", "key": TOKEN_KEY}
    secret = cluster.client.get("v1", "Secret", f"{name}-hf-token", NAMESPACE)
    assert base64.b64decode(secret["data"][TOKEN_KEY]).decode() == TOKEN
    assert secret["metadata"]["ownerReferences"][0]["uid"] == ft["metadata"]["uid"]
    assert TOKEN not in result.out + result.err
    assert cluster.client.get("kubeflow.org/v1", "PyTorchJob", name, NAMESPACE) is None  # the operator's to make
    again = run_cli_redirected("k8s", "submit", *RECIPE_ARGS, "--via-operator")
    errors = [line for line in again.err.splitlines() if line.startswith("kubetune: error:")]
    assert again.code == 2 and len(errors) == 1 and errors[0].endswith("removes it")


def test_submit_via_operator_refuses_bad_input_in_one_line_before_sending(cluster):
    bad = run_cli_redirected("k8s", "submit", "smollm2-135m-lora-cpu", "train.max_stepz=3", "--via-operator")
    assert bad.code == 2
    assert bad.err.strip() == "kubetune: error: unknown recipe key `train.max_stepz`: did you mean `train.max_steps`?"
    option = run_cli_redirected("k8s", "submit", *RECIPE_ARGS, "--via-operator", "--serve", "--model-image", "x")
    assert option.code == 2 and "--model-image: not a FineTune option" in option.err
    assert cluster.client.list(API_VERSION, KIND, NAMESPACE) == []


def test_status_reads_the_finetune(cluster):
    ft = cluster.apply_finetune("demo", {"recipe": {"train": {"max_steps": 40}}})
    status = {
        "phase": "Running",
        "progress": {"step": 12, "totalSteps": 40, "percent": 30, "loss": 1.2345, "eta": "2m", "etaSeconds": 120},
        "conditions": [
            {"type": "Valid", "status": "True", "reason": "RecipeValid", "message": ""},
            {"type": "Restarted", "status": "True", "reason": "PodRestarted", "message": "pod x: OOMKilled\nfix: more"},
        ],
    }
    cluster.client.patch_status(API_VERSION, KIND, "demo", NAMESPACE, status)
    result = run_cli_redirected("k8s", "status", "demo", "-n", NAMESPACE)
    assert result.code == 0, result.err
    assert result.out.splitlines() == [
        "FineTune kubetune/demo: Running",
        "progress: step 12/40 (30%)  loss 1.2345  eta 2m",
        "  Valid=True RecipeValid",
        "  Restarted=True PodRestarted: pod x: OOMKilled",
        "    fix: more",
    ]  # no PyTorchJob (suspended, or not created yet): the FineTune's status alone
    assert ft["metadata"]["uid"]


def test_operator_command_needs_a_scope():
    result = run_cli_redirected("pod", "operator")
    assert result.code == 2
    assert result.err.strip().endswith("kubetune pod operator: give --namespace NS (repeatable) or --all-namespaces")
    assert (
        run_cli_redirected("pod", "operator", "--namespace", "a", "--interval", "0").err.strip().endswith("more than 0")
    )
    assert run_cli_redirected("pod", "operator", "-n", "a").code == 2  # -n is the one namespace a command acts in


def test_the_old_spelling_of_the_operator_still_runs_it():
    # what operator Deployments applied before `kubetune pod operator` run
    old = run_cli_redirected("operator", "--namespace", "a", "--interval", "0")
    assert old.code == 2 and old.err.strip().endswith("seconds, more than 0")
