"""`kubetune k8s render` as a user runs it: stdout, -o DIR for kustomize, --check, bad input."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from .conftest import TOKEN

SEED = "llama2-7b-medical-flashcards"


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)


def test_stdout_is_multidoc_yaml_without_the_token(cli, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    result = cli("k8s", "render", SEED, "--profile", "gaudi", "--api", "pytorchjob")
    assert result.code == 0, result.err
    docs = [d for d in yaml.safe_load_all(result.out) if d]
    kinds = ["Namespace", "PersistentVolumeClaim", "ConfigMap", "PodMonitor", "Pod", "PyTorchJob"]
    assert [d["kind"] for d in docs] == kinds
    assert "# Secret llama2-7b-medical-flashcards-hf-token: not printed" in result.out
    assert TOKEN not in result.out + result.err


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
            "Namespace",
            "ResourceQuota",
            "PersistentVolumeClaim",
            "Secret",
            "ConfigMap",
            "ClusterTrainingRuntime",
            "PodMonitor",
            "Pod",
            "TrainJob",
        ]
    )
    assert {
        d["metadata"].get("namespace") for d in docs if d["kind"] not in ("Namespace", "ClusterTrainingRuntime")
    } == {"team-ml"}


def test_check_validates_and_says_so(cli):
    result = cli("k8s", "render", SEED, "--profile", "nvidia", "--check", "k8s.gang=volcano", "k8s.queue=q")
    assert result.code == 0, result.err
    assert "checked 7 objects: all valid" in result.err


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
