"""`monitor.report_to`: a tiny run logged to a real MLflow server, TensorBoard and W&B (offline),
read back through each library's own reader and compared with metrics.jsonl; a resume continues the
same tracking runs; an unreachable tracker warns (or, required, stops before step 1); no secret
reaches the parameters."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kubetune.netutil import free_port
from kubetune.training.run import train_from_recipe
from tests.kit.cli import run_cli_in_process
from tests.kit.processes import base_env, finish, start_kubetune
from tests.kit.trackers import wandb_config, wandb_history

from ..conftest import tiny_recipe, write_qa_file

pytestmark = pytest.mark.process

TOKEN = "hf_kubetuneTestTokenNeverLogged42"  # a Hugging Face token in the environment, as in a pod
PRIORITY = f"team-{TOKEN}"  # a recipe value that holds it (pasted by mistake): left out of the parameters
SECRET_REF = "tracking-credentials"  # a recipe field that names a Secret: a name, logged like any value


def rows(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def expected(run: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as the trackers must hold it: name -> step -> value (step_s's phases as step_s/PHASE)."""
    out: dict[str, dict[int, float]] = {}
    for row in rows(run):
        for name, value in row.items():
            if name == "step":
                continue
            pairs = value.items() if isinstance(value, dict) else [(None, value)]
            for key, v in pairs:
                out.setdefault(f"{name}/{key}" if key else name, {})[row["step"]] = float(v)
    return out


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, tiny_model_dir, mlflow_tracking_server):
    """A run to step 3 (stopped by its step count), then resumed to step 5, logging to MLflow,
    TensorBoard and W&B offline. Returns (run dir, MLflow run id after the first part)."""
    tmp = tmp_path_factory.mktemp("tracked")
    run = tmp / "run"
    overrides = tiny_recipe(tiny_model_dir, write_qa_file(tmp / "qa.jsonl"), tmp / "cache") + [
        f"output_dir={run}",
        "eval.generate=0",
        "train.save_every=0",
        "monitor.report_to=[mlflow,tensorboard,wandb]",
        "monitor.report_to_required=true",
        f"monitor.tracking_env_from.secret={SECRET_REF}",
        f"k8s.priority_class={PRIORITY}",
    ]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", mlflow_tracking_server.uri)
        env.setenv("MLFLOW_EXPERIMENT_NAME", "kubetune-tests")
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        env.setenv("HF_TOKEN", TOKEN)
        train_from_recipe(None, [*overrides, "train.max_steps=3"])
        first_id = json.loads((run / "tracking.json").read_text())["mlflow"]["run_id"]
        train_from_recipe(None, [*overrides, "train.max_steps=5"])
    return run, first_id


@pytest.fixture(scope="module")
def mlflow_run(tracked, mlflow_tracking_server):
    from mlflow import MlflowClient

    run, _ = tracked
    client = MlflowClient(mlflow_tracking_server.uri)
    run_id = json.loads((run / "tracking.json").read_text())["mlflow"]["run_id"]
    return client, client.get_run(run_id)


def test_mlflow_holds_every_metrics_row_under_its_name_and_step(tracked, mlflow_run):
    run, _ = tracked
    client, mlrun = mlflow_run
    want = expected(run)
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4, 5]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_s/compute"} <= set(want)
    for name, by_step in want.items():
        history = client.get_metric_history(mlrun.info.run_id, name)
        assert {m.step: m.value for m in history} == pytest.approx(by_step), name
    assert mlrun.info.status == "FINISHED"


def test_a_resumed_run_continues_the_same_mlflow_run(tracked, mlflow_run):
    _, first_id = tracked
    _, mlrun = mlflow_run
    assert mlrun.info.run_id == first_id
    assert len({m.step for m in mlflow_run[0].get_metric_history(first_id, "loss")}) == 5  # both parts, one run


def test_mlflow_params_are_the_resolved_recipe_without_secrets(tracked, mlflow_run):
    _, mlrun = mlflow_run
    params = mlrun.data.params
    assert params["train.lr"] == "0.01"
    assert params["train.precision"] == "fp32"
    assert params["monitor.tracking_env_from.secret"] == SECRET_REF
    assert params["monitor.report_to"] == '["mlflow", "tensorboard", "wandb"]'
    assert "k8s.priority_class" not in params  # it held the token
    assert not [k for k, v in params.items() if TOKEN in v or TOKEN in k]


def test_mlflow_holds_the_adapter_summary_and_loss_plot(tracked, mlflow_run):
    run, _ = tracked
    client, mlrun = mlflow_run
    top = {a.path for a in client.list_artifacts(mlrun.info.run_id)}
    assert {"adapter", "summary.json", "loss_curve.png"} <= top
    adapter = {Path(a.path).name for a in client.list_artifacts(mlrun.info.run_id, "adapter")}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= adapter
    local = client.download_artifacts(mlrun.info.run_id, "summary.json", str(run.parent))
    assert json.loads(Path(local).read_text()) == json.loads((run / "summary.json").read_text())


def test_tensorboard_events_equal_metrics_jsonl(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = tracked
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    for name, by_step in expected(run).items():
        assert scalars[name] == pytest.approx(by_step, rel=1e-6), name  # events store float32
    assert set(scalars["system/rss_mb"]) == {1, 2, 3, 4, 5}
    assert "loss_curve" in events.Tags()["images"]
    recipe_text = str(events.Tensors("recipe/text_summary")[0].tensor_proto.string_val[0])
    assert "train.lr = 0.01" in recipe_text and TOKEN not in recipe_text


def test_wandb_offline_run_files_hold_the_same_metrics_and_no_secret(tracked):
    run, _ = tracked
    wandb_id = json.loads((run / "tracking.json").read_text())["wandb"]["id"]
    files = sorted((run / "wandb").glob(f"offline-run-*-{wandb_id}/run-{wandb_id}.wandb"))
    assert len(files) == 2  # the first part's and the resumed part's, under one run id
    history = wandb_history(files)
    for name, by_step in expected(run).items():
        assert history[name] == pytest.approx(by_step), name
    config = wandb_config(files)
    assert config["train.lr"] == "0.01" and "k8s.priority_class" not in config
    assert TOKEN not in json.dumps(config)


@pytest.fixture
def closed_port_uri(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")


def test_an_unreachable_tracker_warns_once_and_training_goes_on(tmp_path, tiny_overrides, closed_port_uri, caplog):
    run = tmp_path / "run"
    args = [*tiny_overrides, f"output_dir={run}", "train.max_steps=2", "eval.generate=0", "monitor.report_to=[mlflow]"]
    with caplog.at_level(logging.WARNING, logger="kubetune"):
        summary = train_from_recipe(None, args)
    warnings = [r.getMessage() for r in caplog.records if "monitor.report_to" in r.getMessage()]
    assert len(warnings) == 1 and "mlflow cannot be reached" in warnings[0], warnings
    assert summary.steps == 2 and (run / "adapter").is_dir()


def test_a_required_unreachable_tracker_stops_before_step_1_with_one_line(
    tmp_path, tiny_overrides, closed_port_uri, capfd
):
    run = tmp_path / "run"
    args = [*tiny_overrides, f"output_dir={run}", "eval.generate=0", "train.save_every=2"]
    train_from_recipe(None, [*args, "train.max_steps=2"])  # trained without tracking
    trained = {p.name: p.read_bytes() for p in (run / "checkpoints" / "step-2").iterdir() if p.is_file()}
    metrics = (run / "metrics.jsonl").read_text()
    tracked = [*args, "train.max_steps=4", "monitor.report_to=[mlflow]", "monitor.report_to_required=true"]
    result = run_cli_in_process(["train", *tracked], capfd)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [ln for ln in result.stderr.splitlines() if "error" in ln]
    assert len(lines) == 1 and "monitor.report_to: mlflow cannot be reached" in lines[0], result.stderr[-3000:]
    assert "MLFLOW_TRACKING_URI" in lines[0] and "monitor.report_to_required=false" in lines[0]
    assert "Traceback" not in result.stderr
    assert (run / "metrics.jsonl").read_text() == metrics  # not one step more
    assert {p.name: p.read_bytes() for p in (run / "checkpoints" / "step-2").iterdir() if p.is_file()} == trained


@pytest.mark.slow  # ~35 s of two process starts: the other trackers cover what all share (RunLog's rows, Tracking)
def test_trackio_run_holds_the_metrics_rows(tmp_path, tiny_overrides):
    """`kubetune train` as a process logging to Trackio's local store (TRACKIO_DIR, which Trackio reads
    once, at import), read back by Trackio's own SQLiteStorage in another process."""
    run = tmp_path / "run"
    store = {"TRACKIO_DIR": str(tmp_path / "trackio")}
    args = ["train", *tiny_overrides, f"output_dir={run}", "train.max_steps=2", "eval.generate=0"]
    finish(start_kubetune([*args, "monitor.report_to=[trackio]", "monitor.report_to_required=true"], base_env(**store)))
    read_back = (
        "import json, sys; from trackio import SQLiteStorage; "
        "print(json.dumps(SQLiteStorage.get_logs('kubetune', 'run', scalar_only=True), default=str))"
    )
    out = subprocess.run([sys.executable, "-c", read_back], env=base_env(**store), capture_output=True, text=True)
    logs = json.loads(out.stdout.strip().splitlines()[-1])
    logged = {}
    for entry in logs:
        for name, value in entry.items():
            if isinstance(value, (int, float)) and name not in ("step", "timestamp"):
                logged.setdefault(name, {})[entry["step"]] = value
    for name, by_step in expected(run).items():
        assert logged[name] == pytest.approx(by_step), name


class BrokenAfter:
    """A tracker whose server goes away after `rows` rows (the fan-out's side of a failure mid-run)."""

    name = "mlflow"

    def __init__(self, rows: int):
        self.rows, self.logged, self.closed = rows, [], False

    def log(self, metrics, step):
        if len(self.logged) == self.rows:
            raise ConnectionError("Connection refused")
        self.logged.append(step)

    def close(self, finished):
        self.closed = True


def test_a_tracker_that_fails_mid_run_warns_once_and_the_others_go_on(caplog):
    from kubetune.training.tracking import Tracking

    tracking = Tracking()
    broken, healthy = BrokenAfter(rows=2), BrokenAfter(rows=99)
    healthy.name = "tensorboard"
    tracking.trackers = [broken, healthy]
    with caplog.at_level(logging.WARNING, logger="kubetune"):
        for step in range(1, 6):
            tracking.row({"step": step, "loss": 1.0 / step, "step_s": {"compute": 0.1}})
        tracking.close(finished=True)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "mlflow could not log metrics (Connection refused)" in warnings[0], warnings
    assert broken.logged == [1, 2] and not broken.closed  # dropped: not called again, not even to close
    assert healthy.logged == [1, 2, 3, 4, 5] and healthy.closed


@pytest.mark.slow  # a process killed mid-run, then resumed: the stopped-by-steps resume above is the default case
def test_sigkill_then_resume_keeps_metrics_jsonls_trajectory_and_the_mlflow_run(tmp_path, tiny_overrides, caplog):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.kit.processes import wait_for_checkpoint

    from ..conftest import resumed_here

    run = tmp_path / "run"
    common = [*tiny_overrides, f"output_dir={run}", "train.max_steps=16", "train.save_every=4", "eval.generate=0"]
    common += ["train.log_every=1", "monitor.report_to=[tensorboard,mlflow]"]  # mlflow: RUN/mlflow.db
    proc = start_kubetune(["train", *common])
    wait_for_checkpoint(run, 4, proc)
    while max((r["step"] for r in rows(run)), default=0) < 6:  # logged past its last checkpoint
        assert proc.poll() is None
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    logged_before = max(r["step"] for r in rows(run))
    newest = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").iterdir() if (p / "meta.json").exists())
    # points the resumed run logs again: TensorBoard shows the resumed ones (purge_step, and its reader drops
    # a step that goes back in any case), as metrics.jsonl keeps them
    assert logged_before > newest
    first_id = json.loads((run / "tracking.json").read_text())["mlflow"]["run_id"]
    resumed_here(common, caplog)
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    loss = {e.step: e.value for e in events.Scalars("loss")}
    assert loss == pytest.approx(expected(run)["loss"], rel=1e-6)
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    assert client.get_run(first_id).info.status == "FINISHED"  # the killed run's, continued to the end
    assert json.loads((run / "tracking.json").read_text())["mlflow"]["run_id"] == first_id
    assert {"adapter", "summary.json"} <= {a.path for a in client.list_artifacts(first_id)}
    assert any((run / "mlartifacts").rglob("adapter_config.json"))  # beside its store, not in ./mlruns
