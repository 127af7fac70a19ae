"""Which namespace the commands work in, as kubectl decides it: -n, else the recipe's
k8s.namespace where it sets one (submit), else the kubeconfig context's (a pod: its service
account's), else `default`; and every hint they print carries that `-n`."""

from __future__ import annotations

import pytest
import yaml

from kubetune.kubeapi import ClusterError, resolve_namespace
from kubetune.kubeapi import config as kubeapi_config

RECIPE = "smollm2-135m-lora-cpu"  # sets no k8s.namespace
JOB = RECIPE
TEAM = "team-a"


def _kubeconfig(path, namespace: str | None, context: str = "work", server: str = "http://127.0.0.1:1"):
    context_body = {"cluster": context, "user": "u", **({"namespace": namespace} if namespace else {})}
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": context,
                "clusters": [{"name": context, "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "not-a-secret"}}],
                "contexts": [{"name": context, "context": context_body}],
            }
        )
    )
    return path


@pytest.fixture
def team_context(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "config", TEAM)))


# ------------------------------------------------------------------------------ the order


def test_the_context_namespace_unless_the_recipe_or_n_says_otherwise(team_context):
    assert resolve_namespace(None) == TEAM
    assert resolve_namespace(None, recipe_namespace="from-recipe") == "from-recipe"
    assert resolve_namespace("from-flag", recipe_namespace="from-recipe") == "from-flag"


def test_a_kubeconfig_list_gives_the_namespace_of_the_context_the_client_connects_to(tmp_path, monkeypatch):
    from kubetune.kubeapi import load_config

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    first = _kubeconfig(tmp_path / "first", "team-b", context="b", server="http://127.0.0.1:2")
    second = _kubeconfig(tmp_path / "second", TEAM, context="a", server="http://127.0.0.1:3")
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'absent'}:{first}:{second}")
    # The kubernetes client merges the files (its current-context: the last file's that sets one);
    # whichever context that is, the namespace must be the one of the server it talks to.
    by_server = {"http://127.0.0.1:2": "team-b", "http://127.0.0.1:3": TEAM}
    assert resolve_namespace(None) == by_server[load_config().host]


@pytest.mark.parametrize("setup", ["context without a namespace", "no kubeconfig at all"])
def test_default_when_nothing_names_a_namespace(tmp_path, monkeypatch, setup):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    path = _kubeconfig(tmp_path / "config", None) if setup.startswith("context") else tmp_path / "absent"
    monkeypatch.setenv("KUBECONFIG", str(path))
    assert resolve_namespace(None) == "default"


def test_in_a_pod_the_service_accounts_namespace(tmp_path, monkeypatch):
    namespace_file = tmp_path / "namespace"
    namespace_file.write_text("team-pod\n")
    monkeypatch.setattr(kubeapi_config, "SERVICE_ACCOUNT_NAMESPACE", namespace_file)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    assert resolve_namespace(None) == "team-pod"


def test_a_malformed_kubeconfig_is_one_error_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    broken = tmp_path / "config"
    broken.write_text("clusters: [\n")
    monkeypatch.setenv("KUBECONFIG", str(broken))
    with pytest.raises(ClusterError, match=f"the kubeconfig {broken} is not valid YAML"):
        resolve_namespace(None)


# ------------------------------------------------------------------------------ the commands


@pytest.fixture
def team_kube(kube):
    """The in-memory API, reached through a kubeconfig whose context's namespace is team-a."""
    config = yaml.safe_load(kube.kubeconfig.read_text())
    config["contexts"][0]["context"]["namespace"] = TEAM
    kube.kubeconfig.write_text(yaml.safe_dump(config))
    kube.script_namespace(TEAM)
    return kube


def _jobs(kube):
    return list(kube.objects("kubeflow.org/v1/pytorchjobs"))


def test_submit_status_doctor_delete_work_in_the_context_namespace(cli, team_kube):
    submitted = cli("k8s", "submit", RECIPE)
    assert submitted.code == 0, submitted.err
    assert _jobs(team_kube) == [(TEAM, JOB)]
    assert f"follow it: kubetune k8s status {JOB} -n {TEAM}" in submitted.out

    status = cli("k8s", "status", JOB)
    assert status.code == 0, status.err
    assert status.out.splitlines()[0].startswith(f"PyTorchJob {TEAM}/{JOB}:")
    assert f"`kubetune k8s doctor {JOB} -n {TEAM}` explains why" in status.out  # no pods yet

    failed = {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}
    team_kube.client().patch_status("kubeflow.org/v1", "PyTorchJob", JOB, TEAM, failed)
    doctor = cli("k8s", "doctor", JOB)
    assert doctor.code == 1 and "Failed: BackoffLimitExceeded" in doctor.out, doctor.out + doctor.err
    assert f"`kubetune k8s delete {JOB} -n {TEAM}` and submit again" in doctor.out

    elsewhere = cli("k8s", "status", JOB, "-n", "kubetune")  # -n wins over the context
    assert elsewhere.code == 2 and f"no PyTorchJob or TrainJob named {JOB} in namespace kubetune" in elsewhere.err

    deleted = cli("k8s", "delete", JOB)
    assert f"deleted PyTorchJob {TEAM}/{JOB}" in deleted.out
    assert f"`kubetune k8s download {JOB} -n {TEAM}`" in deleted.out
    assert _jobs(team_kube) == []


def test_submit_takes_the_recipes_namespace_over_the_context_and_n_over_both(cli, team_kube):
    team_kube.script_namespace("team-b")
    team_kube.script_namespace("team-c")
    by_recipe = cli("k8s", "submit", RECIPE, "k8s.namespace=team-b")
    assert by_recipe.code == 0, by_recipe.err
    by_flag = cli("k8s", "submit", RECIPE, "k8s.namespace=team-b", "-n", "team-c", "k8s.name=other")
    assert by_flag.code == 0, by_flag.err
    assert sorted(_jobs(team_kube)) == [("team-b", JOB), ("team-c", "other")]


def test_render_keeps_the_recipes_namespace_whatever_the_context(cli, team_context):
    rendered = cli("k8s", "render", RECIPE)
    assert rendered.code == 0, rendered.err
    namespaces = {(obj.get("metadata") or {}).get("namespace") for obj in yaml.safe_load_all(rendered.out) if obj} - {
        None
    }
    assert namespaces == {"kubetune"}
