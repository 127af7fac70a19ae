"""`kubetune k8s render` as a user runs it: stdout, -o DIR for kustomize, --check, bad input."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from kubetune.k8s.names import NAMESPACE_QUOTA

from .conftest import TOKEN

pytestmark = pytest.mark.process

SEED = "llama2-7b-medical-flashcards"


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)


def test_stdout_is_multidoc_yaml_without_the_token(cli, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    result = cli("k8s", "render", SEED, "--profile", "gaudi", "--api", "pytorchjob")
    assert result.code == 0, result.err
    docs = [d for d in yaml.safe_load_all(result.out) if d]
    kinds = ["PersistentVolumeClaim", "ConfigMap", "Pod", "PyTorchJob"]
    assert [d["kind"] for d in docs] == kinds  # no Namespace unless asked for, no PodMonitor unless asked for
    assert "# Secret llama2-7b-medical-flashcards-hf-token: not printed" in result.out
    assert "# PodMonitor llama2-7b-medical-flashcards-metrics: not printed" in result.out
    monitored = cli("k8s", "render", SEED, "--monitoring", "prometheus-operator")
    assert "PodMonitor" in [d["kind"] for d in yaml.safe_load_all(monitored.out) if d]
    assert TOKEN not in result.out + result.err
    asked = cli("k8s", "render", SEED, "--create-namespace", "k8s.namespace=team-ml")
    assert asked.code == 0, asked.err
    first = next(d for d in yaml.safe_load_all(asked.out) if d)
    assert (first["kind"], first["metadata"]["name"]) == ("Namespace", "team-ml")


def test_output_dir_applies_with_kustomize(cli, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    out = tmp_path / "manifests"
    result = cli(
        "k8s",
        "render",
        SEED,
        "--profile",
        "cpu",
        "--api",
        "trainjob",
        "--with-runtime",
        "--hf-token-file",
        str(token_file),
        "-o",
        str(out),
        "k8s.namespace=team-ml",
        "k8s.quota=true",
    )
    assert result.code == 0, result.err
    assert f"kubectl apply -k {out}" in result.err and result.out == ""
    assert "namespace team-ml must exist (`kubectl create namespace team-ml`, or --create-namespace)" in result.err
    names = sorted(p.name for p in out.iterdir())
    assert "kustomization.yaml" in names and "secret-llama2-7b-medical-flashcards-hf-token.yaml" in names
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: cannot run `kubectl kustomize`")
    built = subprocess.run(["kubectl", "kustomize", str(out)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "ResourceQuota",
            "PersistentVolumeClaim",
            "Secret",
            "ConfigMap",
            "ClusterTrainingRuntime",
            "Pod",
            "TrainJob",
        ]
    )
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "ClusterTrainingRuntime"} == {"team-ml"}


def _kustomized(directory) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: cannot run `kubectl kustomize`")
    built = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    return [d for d in yaml.safe_load_all(built.stdout) if d]


def test_kubectl_delete_k_of_any_shipped_job_deletes_no_namespace_nor_its_budget(tmp_path):
    # what `kubectl delete -k DIR` deletes is what `kubectl kustomize DIR` builds: never the Namespace, which
    # may hold far more than the job (seed 002's `kubeflow` holds the Training Operator), nor the team's quota,
    # nor a PriorityClass other jobs may use
    from kubetune.k8s import render as r
    from kubetune.recipe.loader import builtin_recipes, load_recipe

    for recipe_name in builtin_recipes():
        for profile in ("cpu", "gaudi", "nvidia"):
            shared = ["k8s.namespace_quota.pods=1000", "k8s.priority_class=team-high", "k8s.priority_value=1000"]
            recipe = load_recipe(recipe_name, [f"k8s.profile={profile}", *shared]).recipe
            out = tmp_path / f"{recipe_name}-{profile}"
            written = [p.name for p in r.write_dir(r.render(recipe).objects, out, create_namespace=True)]
            # asked for, both are written beside the kustomization, to create once
            beside = {f"namespace-{recipe.k8s.namespace}.yaml", f"resourcequota-{NAMESPACE_QUOTA}.yaml"}
            assert beside | {"priorityclass-team-high.yaml"} <= set(written)
            kinds = [d["kind"] for d in _kustomized(out)]
            assert not {"Namespace", "ResourceQuota", "PriorityClass"} & set(kinds), (recipe_name, profile, kinds)
            assert "PyTorchJob" in kinds or "TrainJob" in kinds, (recipe_name, profile, kinds)


def test_create_namespace_writes_it_outside_the_kustomization(cli, tmp_path):
    out = tmp_path / "manifests"
    result = cli("k8s", "render", SEED, "-o", str(out), "--create-namespace", "k8s.namespace=team-ml")
    assert result.code == 0, result.err
    namespace_file = out / "namespace-team-ml.yaml"
    assert f"after `kubectl create -f {namespace_file}`" in result.err
    assert yaml.safe_load(namespace_file.read_text())["kind"] == "Namespace"
    assert namespace_file.name not in yaml.safe_load((out / "kustomization.yaml").read_text())["resources"]


def test_check_validates_and_says_so(cli, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # Llama 2 is gated: --check wants a token
    result = cli("k8s", "render", SEED, "--profile", "nvidia", "--check", "k8s.gang=volcano", "k8s.queue=q")
    assert result.code == 0, result.err
    assert "checked 8 objects: all valid" in result.err  # the token's Secret among them
    assert "PodMonitor llama2-7b-medical-flashcards-metrics: valid, but left out" in result.err
    assert "add --monitoring prometheus-operator where the cluster has them" in result.err
    bad = cli("k8s", "render", SEED, "--monitoring", "prometheus")
    assert bad.code == 2 and "--monitoring prometheus: use prometheus-operator" in bad.err


def _kubectl(kube, *args: str) -> subprocess.CompletedProcess:
    """The real kubectl against the in-memory API server. kmock's core discovery names the group
    version "/v1" (kubectl then maps no core kind) and it serves no OpenAPI document (hence
    --validate=false): answer /api/v1 as a cluster does."""
    from .conftest import RESOURCES

    core = [
        {"name": plural.split("/")[1], "singularName": "", "namespaced": namespaced, "kind": kind, "verbs": []}
        for plural, (kind, namespaced) in RESOURCES.items()
        if plural.startswith("v1/")
    ]
    kube.emulator["get /api/v1"] << {"kind": "APIResourceList", "groupVersion": "v1", "resources": core}
    argv = ["kubectl", "--kubeconfig", str(kube.kubeconfig), *args, "--validate=false"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_kubectl_apply_k_works_on_a_cluster_without_the_prometheus_operator(cli, kube, tmp_path):
    # seed 002 installs kube-prometheus-stack last: before it, kubectl refuses a kustomization that
    # holds a PodMonitor as a whole ("no matches for kind", exit 1)
    import kmock

    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    out = tmp_path / "manifests"
    result = cli("k8s", "render", SEED, "-o", str(out))
    assert result.code == 0, result.err
    assert "podmonitor-llama2-7b-medical-flashcards-metrics.yaml is not in kustomization.yaml" in result.err
    applied = _kubectl(kube, "apply", "-k", str(out))
    assert applied.returncode == 0, applied.stderr
    assert "pytorchjob.kubeflow.org/llama2-7b-medical-flashcards created" in applied.stdout
    monitor_file = out / "podmonitor-llama2-7b-medical-flashcards-metrics.yaml"
    assert "--monitoring prometheus-operator" in monitor_file.read_text().splitlines()[2]
    assert yaml.safe_load(monitor_file.read_text())["kind"] == "PodMonitor"  # the comment leaves it valid YAML

    kube.emulator.resources["monitoring.coreos.com/v1/podmonitors"] = kmock.ResourceInfo(kind="PodMonitor")
    with_operator = tmp_path / "with-operator"
    assert cli("k8s", "render", SEED, "-o", str(with_operator), "--monitoring", "prometheus-operator").code == 0
    applied = _kubectl(kube, "apply", "-k", str(with_operator))
    assert applied.returncode == 0, applied.stderr
    assert "podmonitor.monitoring.coreos.com/llama2-7b-medical-flashcards-metrics created" in applied.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--profile", "tpu"], "`k8s.profile`: got 'tpu', expected 'cpu', 'gaudi' or 'nvidia'"),
        (["--api", "mpijob"], "`k8s.api`: got 'mpijob', expected 'pytorchjob' or 'trainjob'"),
        # the seed recipe's memory comes from its cpu profile_resources: the line names that key
        (
            ["k8s.resources.shm_size=300Gi"],
            "k8s.resources.shm_size 300Gi must be smaller than k8s.profile_resources.cpu.memory 226Gi",
        ),
        (["k8s.resources.cpu=0"], "k8s.resources.cpu must be more than 0"),
        (["k8s.resources.accelerators=4"], "accelerators=4 on the cpu profile"),
        (["k8s.replica=3"], "unknown recipe key `k8s.replica`: did you mean `k8s.replicas`?"),
        (["--hf-token-file", "/nonexistent/token"], "cannot read --hf-token-file /nonexistent/token"),
    ],
)
def test_bad_input_is_exit_2_with_one_line(cli, args, message):
    result = cli("k8s", "render", SEED, *args)
    assert result.code == 2
    assert result.out == ""
    assert result.err.count("\n") == 1 and message in result.err, result.err


def test_recipe_is_required(cli):
    result = cli("k8s", "render")
    assert result.code == 2 and "give a recipe" in result.err


def test_local_paths_warn_on_stderr(cli, tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text("{}\n")
    result = cli("k8s", "render", "smollm2-135m-lora-cpu", f"data.train={data}")
    assert result.code == 0
    assert "warning: data.train=" in result.err and "the pods cannot see" in result.err
