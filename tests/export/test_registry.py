"""`kubetune export RUN --register mlflow|kubeflow`: a model version on a real MLflow server with the
run's lineage; Kubeflow's Model Registry (no server here) through its real client, refusing in one line."""

from __future__ import annotations

import json

import pytest

from kubetune.netutil import free_port
from kubetune.rundir import RunDir, fingerprint
from kubetune.training.run import train_from_recipe
from tests.kit.cli import run_cli_in_process

from ..conftest import tiny_recipe, write_qa_file

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, tiny_model_dir, mlflow_tracking_server):
    """A finished tiny run that logged to the MLflow server."""
    tmp = tmp_path_factory.mktemp("registry")
    run = tmp / "flashcards-lora"
    overrides = tiny_recipe(tiny_model_dir, write_qa_file(tmp / "qa.jsonl"), tmp / "cache")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", mlflow_tracking_server.uri)
        args = [*overrides, f"output_dir={run}", "train.max_steps=2", "eval.generate=0", "monitor.report_to=[mlflow]"]
        train_from_recipe(None, args)
    return run


def registered(result) -> tuple[str, str]:
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip().splitlines()[-1]
    _, name, _, version = line.split()
    assert line == f"registered {name} version {version}"
    return name, version


def test_register_mlflow_makes_a_version_with_the_lineage(tracked_run, mlflow_tracking_server, monkeypatch, capfd):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_tracking_server.uri)
    name, version = registered(run_cli_in_process(["export", str(tracked_run), "--register", "mlflow"], capfd))
    assert name == "flashcards-lora"
    client = MlflowClient(mlflow_tracking_server.uri)
    model_version = client.get_model_version(name, version)
    tags = model_version.tags
    recipe = RunDir(tracked_run).recipe()
    summary = json.loads((tracked_run / "summary.json").read_text())
    assert tags["kubetune.base_model"] == recipe.model.name_or_path
    assert tags["kubetune.base_revision"] == "main"
    assert (
        tags["kubetune.recipe_hash"]
        == fingerprint(recipe)
        == json.loads((tracked_run / "run.json").read_text())["fingerprint"]
    )
    assert tags["kubetune.data.train"] == recipe.data.train
    assert tags["kubetune.weights"] == "adapter"
    assert float(tags["kubetune.eval.eval_loss_after"]) == summary["eval_loss_after"]
    assert float(tags["kubetune.eval.perplexity_before"]) == summary["perplexity_before"]
    # registered from the run's own tracking run, whose `model` artifact holds the adapter
    run_id = json.loads((tracked_run / "tracking.json").read_text())["mlflow"]["run_id"]
    assert model_version.run_id == run_id
    files = {a.path for a in client.list_artifacts(run_id, "model")}
    assert {"model/adapter_model.safetensors", "model/adapter_config.json"} <= files


def test_register_mlflow_again_merged_is_the_next_version(tracked_run, mlflow_tracking_server, monkeypatch, capfd):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_tracking_server.uri)
    args = ["export", str(tracked_run), "--merged", "--register", "mlflow", "--registered-name", "tiny-merged"]
    name, first = registered(run_cli_in_process(args, capfd))
    _, second = registered(run_cli_in_process(args, capfd))
    assert (name, int(second)) == ("tiny-merged", int(first) + 1)
    assert MlflowClient(mlflow_tracking_server.uri).get_model_version(name, second).tags["kubetune.weights"] == "merged"


def one_error_line(result) -> str:
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_register_mlflow_without_a_tracking_uri_says_so(tracked_run, monkeypatch, capfd):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    line = one_error_line(run_cli_in_process(["export", str(tracked_run), "--register", "mlflow"], capfd))
    assert "MLFLOW_TRACKING_URI is not set" in line


def test_register_kubeflow_needs_the_registry_url(tracked_run, capfd):
    line = one_error_line(run_cli_in_process(["export", str(tracked_run), "--register", "kubeflow"], capfd))
    assert "--register kubeflow needs --registry-url" in line


def test_register_kubeflow_against_no_server_is_one_line(tracked_run, capfd):
    """The model-registry client itself, refused on a closed loopback port (no server can run here)."""
    url = f"http://127.0.0.1:{free_port()}"
    args = ["export", str(tracked_run), "--register", "kubeflow", "--registry-url", url]
    line = one_error_line(run_cli_in_process(args, capfd))
    assert f"--register kubeflow: {url} refused the model" in line


def test_an_unknown_registry_is_refused(tracked_run, capfd):
    line = one_error_line(run_cli_in_process(["export", str(tracked_run), "--register", "sagemaker"], capfd))
    assert "use one of mlflow, kubeflow" in line
