"""`kubetune export RUN --register mlflow|kubeflow`: the exported weights in a model registry, with
their lineage.

Lineage (`lineage`): the base model and its revision, the recipe hash (the run's fingerprint,
`run.json`), the method and objective, the data files, and the eval results of summary.json.
- mlflow: the weights are logged as the `model` artifact of the run's tracking run (the one
  `monitor.report_to: [mlflow]` logged to, from RUN/tracking.json, when it is on this tracking
  server; a new run otherwise), then registered from it: a new version of the registered model,
  the lineage as its tags. The server is MLFLOW_TRACKING_URI's (MLFLOW_REGISTRY_URI where set),
  as MLflow itself reads them.
- kubeflow: Kubeflow's Model Registry through its `model-registry` client: the registered model,
  a version named by the recipe hash and the time, the model's URI (where the weights lie for
  whoever serves them) and the lineage as the version's metadata.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetune.contracts.gate import REGISTRIES
from kubetune.errors import UserError, first_line
from kubetune.export.gate import tell_operator
from kubetune.recipe import Recipe
from kubetune.rundir import RunDir, fingerprint

MLFLOW_ARTIFACT = "model"  # MLflow's name for a run's model artifact
# summary.json's eval results, copied into the lineage when the run has them
EVAL_KEYS = (
    "eval_loss_before",
    "eval_loss_after",
    "perplexity_before",
    "perplexity_after",
    "reward_accuracy_before",
    "reward_accuracy_after",
    "reward_before",
    "reward_after",
)


__all__ = ["REGISTRIES", "Registered", "lineage", "register_and_report", "register_export"]


@dataclass(frozen=True)
class Registered:
    registry: str
    name: str
    version: str
    uri: str | None = None  # where the registry says the weights are (MLflow's version source)

    def line(self) -> str:
        return f"registered {self.name} version {self.version}"

    def fields(self) -> dict[str, str]:
        """As the export Job's termination message and status.registered carry it."""
        found = {"registry": self.registry, "name": self.name, "version": self.version, "uri": self.uri}
        return {k: v for k, v in found.items() if v is not None}


def lineage(run: RunDir, recipe: Recipe, merged: bool) -> dict[str, str]:
    """Where these weights came from, as flat string tags (what every registry stores)."""
    tags = {
        "kubetune.base_model": recipe.model.name_or_path,
        "kubetune.base_revision": recipe.model.revision or "main",
        "kubetune.recipe_hash": fingerprint(recipe),
        "kubetune.method": recipe.finetune.method,
        "kubetune.objective": recipe.finetune.objective,
        "kubetune.weights": "merged" if merged else run.weights(recipe.finetune.method).name,
        "kubetune.data.train": str(recipe.data.train),
        "kubetune.data.eval": str(recipe.data.eval),
    }
    summary = json.loads(run.summary_file.read_text()) if run.summary_file.is_file() else {}
    evals = {k: summary[k] for k in EVAL_KEYS if summary.get(k) is not None}
    evals.update({f"eval_after.{k}": v for k, v in (summary.get("eval_after") or {}).items()})
    tags.update({f"kubetune.eval.{k}": str(v) for k, v in evals.items()})
    if "steps" in summary:
        tags["kubetune.steps"] = str(summary["steps"])
    return tags


def default_name(run: RunDir) -> str:
    """The run directory's name, in the characters every registry accepts."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", run.path.resolve().name)


def register_export(
    registry: str, run_dir: Path, weights: Path, merged: bool, name: str | None, url: str | None
) -> Registered:
    """Register the weights `kubetune export` wrote (WEIGHTS) of the run in RUN_DIR."""
    run = RunDir(Path(run_dir))
    recipe = run.recipe()
    tags = lineage(run, recipe, merged)
    name = name or default_name(run)
    if registry == "kubeflow":
        return register_kubeflow(weights, name, tags, url, merged)
    return register_mlflow(run, weights, name, tags)


def register_and_report(
    registry: str, run_dir: Path, weights: Path, merged: bool, name: str | None, url: str | None
) -> Registered:
    """`register_export`, its outcome also in the termination message where there is one (the
    export Job's pod): the registered model, or the line saying why the registry refused it."""
    try:
        registered = register_export(registry, run_dir, weights, merged, name, url)
    except UserError as e:
        tell_operator(run_dir, register_error=e.problems[0].splitlines()[0])
        raise
    tell_operator(run_dir, registered=registered.fields())
    return registered


# ----------------------------------------------------------------------------- MLflow


def register_mlflow(run: RunDir, weights: Path, name: str, tags: dict[str, str]) -> Registered:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise UserError(
            "--register mlflow: MLFLOW_TRACKING_URI is not set; set it to the tracking server "
            "(e.g. http://mlflow.mlflow:5000), as for monitor.report_to: [mlflow]"
        )
    try:
        return _register_mlflow(uri, run, weights, name, tags)
    except Exception as e:
        raise UserError(
            f"--register mlflow: {uri} refused the model ({first_line(e)}); check MLFLOW_TRACKING_URI"
        ) from None


def _register_mlflow(uri: str, run: RunDir, weights: Path, name: str, tags: dict[str, str]) -> Registered:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(uri)
    logged = run.tracking_ids().get("mlflow", {})  # the run's own tracking run, when it is on this server
    run_id = logged["run_id"] if logged.get("tracking_uri") == uri else _new_run(client, run)
    client.log_artifacts(run_id, str(weights), MLFLOW_ARTIFACT)
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    source = f"{client.get_run(run_id).info.artifact_uri}/{MLFLOW_ARTIFACT}"
    version = client.create_model_version(name, source, run_id=run_id, tags=tags)
    return Registered("mlflow", name, str(version.version), version.source)


def _new_run(client: Any, run: RunDir) -> str:
    """A tracking run for the registration alone (the run did not log to this server)."""
    experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "kubetune"
    found = client.get_experiment_by_name(experiment_name)
    experiment = found.experiment_id if found else client.create_experiment(experiment_name)
    run_id: str = client.create_run(experiment, run_name=default_name(run)).info.run_id
    client.set_terminated(run_id)
    return run_id


# ----------------------------------------------------------------------------- Kubeflow Model Registry


def register_kubeflow(weights: Path, name: str, tags: dict[str, str], url: str | None, merged: bool) -> Registered:
    if not url:
        raise UserError(
            "--register kubeflow needs --registry-url URL: the Model Registry's REST address "
            "(e.g. https://model-registry-service.kubeflow.svc:8443)"
        )
    version = f"{tags['kubetune.recipe_hash']}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    uri = weights.resolve().as_uri()
    try:
        client = _kubeflow_client(url)
        client.register_model(
            name,
            uri,
            model_format_name="safetensors" if merged or tags["kubetune.method"] == "full" else "peft-lora",
            model_format_version="1",
            version=version,
            version_description=f"kubetune {tags['kubetune.method']} of {tags['kubetune.base_model']}",
            metadata=tags,
        )
    except ImportError as e:
        raise UserError(f"--register kubeflow: {first_line(e)}; pip install 'kubetune[track]'") from None
    except Exception as e:
        raise UserError(
            f"--register kubeflow: {url} refused the model ({first_line(e)}); check --registry-url"
        ) from None
    return Registered("kubeflow", name, version, uri)


def _kubeflow_client(url: str) -> Any:
    """The Model Registry's client, without its start-up remarks: a registry without auth needs
    no token (the pod's, when set, is read), and an http port not ending in 80 is fine (a failure
    to connect is said in one line anyway)."""
    from model_registry import ModelRegistry

    author = os.environ.get("USER") or "kubetune"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="User access token is missing")
        return ModelRegistry(url, author=author, is_secure=url.startswith("https"), log_level=logging.ERROR)
