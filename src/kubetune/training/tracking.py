"""Experiment trackers (`monitor.report_to`): TensorBoard, MLflow, Weights & Biases, Trackio.

Each tracker is written through its library's own client, and only rank 0 logs. What they get:
- the resolved recipe as parameters (flattened keys; a value that holds a secret from the
  environment, such as the Hugging Face token, never leaves the process);
- every row of metrics.jsonl, under its names and step (`RunLog.step` hands them over where it
  writes the row; a step's phase timings as `step_s/<phase>`);
- system metrics: MLflow's, W&B's and Trackio's own samplers; TensorBoard has none, so the
  process's RSS and CPU% go beside each row as `system/rss_mb` and `system/cpu_percent`;
- at the end the trained weights (adapter/ or model/), summary.json and the loss plot (not
  recipe.yaml: the parameters hold it, without secrets).

Where they log comes from the environment as each library documents it (MLFLOW_TRACKING_URI,
WANDB_MODE, WANDB_API_KEY, TRACKIO_SERVER_URL, ...): a cluster job's pods read it from the Secret or
ConfigMap of `monitor.tracking_env_from`. Without MLFLOW_TRACKING_URI MLflow logs to
RUN/mlflow.db, TensorBoard always to RUN/tensorboard.

A resumed run continues the same tracking runs: their ids are kept in RUN/tracking.json.
A tracker that cannot be reached at the start is one warning (with `monitor.report_to_required`:
the run stops before step 1 with one line); one that fails later is one warning and no more
logging to it. Training never waits on a tracker that failed once.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kubetune.errors import UserError, first_line
from kubetune.fsutil import atomic_write_json
from kubetune.recipe.loader import _flatten

if TYPE_CHECKING:
    from kubetune.recipe import Recipe
    from kubetune.rundir import RunDir

log = logging.getLogger("kubetune")

# environment variables whose values are secrets: a parameter that holds one is left out
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
SHORTEST_SECRET = 8  # shorter values ("1", "true") would drop harmless parameters that happen to hold them
MLFLOW_PARAM_LIMIT = 6000  # MLflow refuses longer parameter values
PROBE_TIMEOUT_S = 10

# what to check when a tracker cannot be reached (the second half of the one-line refusal)
FIXES = {
    "tensorboard": "the run directory must be writable and `tensorboard` installed (pip install 'kubetune[track]')",
    "mlflow": "check MLFLOW_TRACKING_URI and its credentials (MLFLOW_TRACKING_TOKEN or _USERNAME/_PASSWORD)",
    "wandb": "set WANDB_API_KEY, or WANDB_MODE=offline to log into the run directory",
    "trackio": "check TRACKIO_SERVER_URL / TRACKIO_SPACE_ID (unset: the local ~/.cache/huggingface/trackio)",
}


class Tracker(Protocol):
    """One experiment tracker, as rank 0 uses it."""

    name: str

    def saved_id(self) -> dict[str, Any]:
        """What continues this tracking run after a resume (kept in RUN/tracking.json)."""
        ...

    def start(self, params: dict[str, str], start_step: int) -> None: ...

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def artifacts(self, files: list[Path], weights: Path) -> None: ...

    def close(self, finished: bool) -> None: ...


# ----------------------------------------------------------------------------- what is logged


def recipe_params(recipe: Recipe) -> dict[str, str]:
    """The resolved recipe as flat `section.key` parameters, without any value that holds a secret
    of this process's environment (the token among them)."""
    secrets = [v for k, v in os.environ.items() if SECRET_NAME.search(k) and len(v) >= SHORTEST_SECRET]
    flat = {k: v if isinstance(v, str) else json.dumps(v) for k, v in _flatten(recipe.model_dump(mode="json")).items()}
    return {k: v for k, v in flat.items() if not any(s in v for s in secrets)}


def metric_values(row: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl row as a tracker's scalars: its numbers under their names (the step is the
    x axis, not a value), a nested table's (`step_s`) as `name/key`."""
    out: dict[str, float] = {}
    for name, value in row.items():
        if isinstance(value, dict):
            out.update({f"{name}/{k}": float(v) for k, v in value.items() if _is_number(v)})
        elif name != "step" and _is_number(value):
            out[name] = float(value)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run_name(run_dir: RunDir) -> str:
    return run_dir.path.resolve().name


# ----------------------------------------------------------------------------- the adapters


class TensorBoardTracker:
    """torch's SummaryWriter into RUN/tensorboard; a resume purges the events after its step."""

    name = "tensorboard"

    def __init__(self, run_dir: RunDir, saved: dict[str, Any]):
        import tensorboard  # noqa: F401 (torch's writer needs it: fail here, not at the first row)

        self.log_dir = run_dir.path / "tensorboard"  # always the run's own: a run directory may move (a volume)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer: Any = None

    def saved_id(self) -> dict[str, Any]:
        return {"log_dir": str(self.log_dir)}

    def start(self, params: dict[str, str], start_step: int) -> None:
        import psutil
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: the events a killed run wrote after its last checkpoint are dropped, as metrics.jsonl's are
        self.writer = SummaryWriter(str(self.log_dir), purge_step=start_step + 1 if start_step else None)
        self.writer.add_text("recipe", "\n".join(f"    {k} = {v}" for k, v in sorted(params.items())), start_step)
        self.process = psutil.Process()
        self.process.cpu_percent()  # the first call starts the interval the next one measures

    def log(self, metrics: dict[str, float], step: int) -> None:
        system = {
            "system/rss_mb": self.process.memory_info().rss / 2**20,
            "system/cpu_percent": self.process.cpu_percent(),
        }
        for name, value in {**metrics, **system}.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a row is readable as soon as metrics.jsonl has it

    def artifacts(self, files: list[Path], weights: Path) -> None:
        """TensorBoard keeps no files: the summary as text, the loss plot as an image."""
        import matplotlib.image

        for f in files:
            if f.suffix == ".png":
                self.writer.add_image(f.stem, matplotlib.image.imread(f)[..., :3], dataformats="HWC")
            elif f.suffix in (".json", ".yaml"):
                self.writer.add_text(f.name, "    " + f.read_text().replace("\n", "\n    "))

    def close(self, finished: bool) -> None:
        if self.writer is not None:
            self.writer.close()


class MlflowTracker:
    """An MLflow run through MlflowClient (its id kept: a resume continues it), with MLflow's own
    system metrics monitor."""

    name = "mlflow"

    def __init__(self, run_dir: RunDir, saved: dict[str, Any]):
        from mlflow import MlflowClient

        # without a server: a store in the run directory, its artifacts beside it (MLflow's default is ./mlruns)
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.path.resolve() / 'mlflow.db'}"
        probe_mlflow(self.uri)
        self.client = MlflowClient(self.uri)
        if saved.get("run_id") and saved.get("tracking_uri") == self.uri:
            self.run_id, self.resumed = saved["run_id"], True
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = mlflow_experiment(self.client, run_dir.path / "mlartifacts" if local else None)
            self.run_id = self.client.create_run(experiment, run_name=run_name(run_dir)).info.run_id
            self.resumed = False
        self.monitor: Any = None

    def saved_id(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def start(self, params: dict[str, str], start_step: int) -> None:
        from mlflow.entities import Param
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logged = self.client.get_run(self.run_id).data.params
        new = {k: v[:MLFLOW_PARAM_LIMIT] for k, v in params.items() if k not in logged}
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v[:MLFLOW_PARAM_LIMIT])
        if changed:  # MLflow's parameters are immutable: a resume with new neutral keys keeps the first values
            log.info("mlflow: keeps the first run's values of %s (MLflow parameters cannot change)", ", ".join(changed))
        for chunk in _chunks(sorted(new.items()), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in chunk])
        self.monitor = SystemMetricsMonitor(self.run_id, tracking_uri=self.uri, resume_logging=self.resumed)
        self.monitor.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.time import get_current_time_millis

        now = get_current_time_millis()
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def artifacts(self, files: list[Path], weights: Path) -> None:
        self.client.log_artifacts(self.run_id, str(weights), weights.name)
        for f in files:
            self.client.log_artifact(self.run_id, str(f))

    def close(self, finished: bool) -> None:
        if self.monitor is not None:
            self.monitor.finish()
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


def probe_mlflow(uri: str) -> None:
    """One request with no retries: an unreachable server answers in seconds, not after MLflow's
    retries (minutes), so that the run goes on (or stops) at once."""
    from mlflow.tracking._tracking_service.utils import get_default_host_creds
    from mlflow.utils.rest_utils import http_request
    from mlflow.utils.uri import is_http_uri

    if not is_http_uri(uri):
        return  # a local store (sqlite, file): opening it is the check
    response = http_request(
        get_default_host_creds(uri),
        "/api/2.0/mlflow/experiments/search",
        "GET",
        params={"max_results": 1},
        max_retries=0,
        timeout=PROBE_TIMEOUT_S,
        raise_on_status=False,
    )
    if response.status_code != 200:
        raise RuntimeError(f"{uri} answered HTTP {response.status_code}")


def mlflow_experiment(client: Any, artifacts: Path | None = None) -> str:
    """MLFLOW_EXPERIMENT_NAME's experiment (HF Trainer's variable), `kubetune` without it; made if missing,
    with its artifacts under `artifacts` when given (else where the server keeps them)."""
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "kubetune"
    found = client.get_experiment_by_name(name)
    location = artifacts.resolve().as_uri() if artifacts else None
    return str(found.experiment_id if found else client.create_experiment(name, artifact_location=location))


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class WandbTracker:
    """A W&B run (WANDB_MODE=offline: files under RUN/wandb) with its id kept and resume="allow"."""

    name = "wandb"

    def __init__(self, run_dir: RunDir, saved: dict[str, Any]):
        import wandb

        self.run_dir = run_dir
        self.id = saved.get("id") or uuid.uuid4().hex[:12]  # chosen here: kept for a resume before W&B starts
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "kubetune",
            id=self.id,
            name=run_name(run_dir),
            resume="allow",
            dir=str(run_dir.path),
            reinit="create_new",  # a second run in this process (tests, notebooks) is a run of its own
        )

    def saved_id(self) -> dict[str, Any]:
        return {"id": self.id}

    def start(self, params: dict[str, str], start_step: int) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def artifacts(self, files: list[Path], weights: Path) -> None:
        import wandb

        artifact = wandb.Artifact(re.sub(r"[^\w.-]", "-", f"{run_name(self.run_dir)}-{weights.name}"), type="model")
        artifact.add_dir(str(weights))
        self.run.log_artifact(artifact)
        for f in files:
            self.run.save(str(f), base_path=str(f.parent), policy="now")

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


class TrackioTracker:
    """A Trackio run (its wandb-like API), resumed by its name, with Trackio's own CPU/GPU logging."""

    name = "trackio"

    def __init__(self, run_dir: RunDir, saved: dict[str, Any]):
        import trackio

        self.project = saved.get("project") or os.environ.get("TRACKIO_PROJECT") or "kubetune"
        self.name_ = saved.get("name") or run_name(run_dir)
        self.run = trackio.init(project=self.project, name=self.name_, resume="allow", embed=False, auto_log_cpu=True)

    def saved_id(self) -> dict[str, Any]:
        return {"project": self.project, "name": self.name_}

    def start(self, params: dict[str, str], start_step: int) -> None:
        self.run.config.update(params)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def artifacts(self, files: list[Path], weights: Path) -> None:
        import trackio

        trackio.log_artifact(weights, name=re.sub(r"[^\w.-]", "-", f"{self.name_}-{weights.name}"), type="model")
        for f in files:
            trackio.log_artifact(f, name=re.sub(r"[^\w.-]", "-", f"{self.name_}-{f.name}"))

    def close(self, finished: bool) -> None:
        self.run.finish()


ADAPTERS: dict[str, Any] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MlflowTracker,
    "wandb": WandbTracker,
    "trackio": TrackioTracker,
}


# ----------------------------------------------------------------------------- all of them


class Tracking:
    """The trackers of this run (none on ranks other than 0). A tracker whose call fails is one
    warning and is dropped: training goes on without it."""

    def __init__(self) -> None:
        self.trackers: list[Tracker] = []

    def open(self, recipe: Recipe, run_dir: RunDir, is_main: bool) -> list[str]:
        """Connect rank 0's trackers (the others: none); returns one line per tracker that could not
        be reached when monitor.report_to_required (else they are warnings). Their ids go to
        RUN/tracking.json for a resume."""
        monitor = recipe.monitor
        if not is_main or not monitor.report_to:
            return []
        saved = run_dir.tracking_ids()
        problems = []
        for name in monitor.report_to:
            try:
                self.trackers.append(ADAPTERS[name](run_dir, saved.get(name, {})))
            except Exception as e:
                problems.append(f"monitor.report_to: {name} cannot be reached ({first_line(e)}); {FIXES[name]}")
        atomic_write_json(run_dir.tracking_file, {**saved, **{t.name: t.saved_id() for t in self.trackers}})
        if problems and monitor.report_to_required:
            self.close(finished=False)
            return problems
        for line in problems:
            log.warning("warning: %s; training goes on without it (monitor.report_to_required=true stops)", line)
        return []

    def start(self, recipe: Recipe, start_step: int) -> None:
        if self.trackers:
            params = recipe_params(recipe)
            self._each("log the recipe", lambda t: t.start(params, start_step))

    def row(self, row: dict[str, Any]) -> None:
        """A metrics.jsonl row, as it is written."""
        if self.trackers:
            metrics = metric_values(row)
            self._each("log metrics", lambda t: t.log(metrics, row["step"]))

    def artifacts(self, run_dir: RunDir, weights: Path) -> None:
        files = [f for f in (run_dir.summary_file, run_dir.loss_curve) if f.is_file()]
        self._each("log the artifacts", lambda t: t.artifacts(files, weights))

    def close(self, finished: bool) -> None:
        self._each("close its run", lambda t: t.close(finished))
        self.trackers = []

    def _each(self, what: str, call: Any) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as e:
                log.warning(
                    "warning: monitor.report_to: %s could not %s (%s); no more logging to it in this run, "
                    "training goes on",
                    tracker.name,
                    what,
                    first_line(e),
                )
                self.trackers.remove(tracker)


def refuse_unreachable(problems: list[str]) -> None:
    if problems:
        raise UserError(*(f"{p}, or set monitor.report_to_required=false" for p in problems))
