"""Render (pure): the export Jobs the operator runs when training succeeded: the merged export
(for a full fine-tune with an eval gate, a Job that only checks the gate before it is served) and
a shared server's adapter export.

One pod with the training image, the run's volume claim at /data and the trainers'
environment (caches, Hugging Face token), running `kubetune export RUN_DIR --merged`. It asks
for the CPU and memory of one worker (merging holds the base model in memory) and no
accelerator. No gang labels: it is one pod, scheduled alone.

With `register` (spec.export.register) the Job then registers what it exported in a model
registry (`--register`, after the gate: a run whose gate failed is never registered) and gets
the recipe's monitor.tracking_env_from as envFrom, which carries MLFLOW_TRACKING_URI (and the
registry's credentials) as for the training pods.

For a FineTune served by a ModelServer the same Job copies the adapter instead (not merged) into
the server's adapter volume, mounted at /adapters, and registers it there
(`python -m kubetune.export.adapter_install`); the unregister Job runs the same module on the
server's own claim when the FineTune goes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubetune.contracts.adapter_volume import ROOT as ADAPTER_ROOT
from kubetune.contracts.kube import KubeObject, drop_none
from kubetune.k8s import objects, profiles
from kubetune.k8s.names import DATA_DIR, Names
from kubetune.recipe.schema import Recipe

CONTAINER = "export"
BACKOFF_LIMIT = 2
ADAPTERS_SUBPATH = "adapters"  # where a ModelServer's claim keeps its adapters (its replicas mount it there too)
INSTALL = ["python", "-m", "kubetune.export.adapter_install"]


@dataclass(frozen=True)
class Register:
    """Where the export Job registers the model (`kubetune export --register`)."""

    registry: str  # mlflow | kubeflow
    name: str | None = None  # the registered model's name (default: the run directory's, or the adapter's)
    url: str | None = None  # kubeflow: the Model Registry's address

    def args(self) -> list[str]:
        named = ["--registered-name", self.name] if self.name else []
        return ["--register", self.registry, *named, *(["--registry-url", self.url] if self.url else [])]


def export_command(recipe: Recipe, merged: bool = True, register: Register | None = None) -> list[str]:
    """With eval.gate, the Job exports only a run whose gate passed; with it or eval.tasks, it says
    the verdict and lm-eval's results in its termination message (contracts/gate.py), which the
    operator reads; with `register`, also what it registered. `merged`: a LoRA run's adapter is
    merged (else exported, and registered, as it is); a full run's weights are whole already."""
    merge = ["--merged"] if merged and recipe.finetune.method == "lora" else []
    return ["kubetune", "export", recipe.output_dir, *merge, *_gate(recipe), *(register.args() if register else [])]


def _gate(recipe: Recipe) -> list[str]:
    return ["--gate"] if recipe.eval.gate is not None or recipe.eval.tasks else []


def adapter_install_command(
    recipe: Recipe,
    name: str,
    version: str,
    base: str,
    revision: str | None,
    root: str = ADAPTER_ROOT,
    register: Register | None = None,
) -> list[str]:
    """Copy the run's adapter to ROOT/NAME/VERSION and register it for the server's base (with an
    eval gate, only when it passed); with `register`, then in that model registry too."""
    command = [*INSTALL, recipe.output_dir, "--name", name, "--version", version, "--base", base, "--root", root]
    command += ["--revision", revision] if revision else []
    return command + _gate(recipe) + (register.args() if register else [])


def adapter_uninstall_command(name: str, version: str, delete_files: bool) -> list[str]:
    """Unregister NAME@VERSION from the registry on the server's claim (mounted at /data)."""
    root = f"{DATA_DIR}/{ADAPTERS_SUBPATH}"
    command = [*INSTALL, "--unregister", "--name", name, "--version", version, "--root", root]
    return command + (["--delete-files"] if delete_files else [])


def _container(
    recipe: Recipe, names: Names, command: list[str], adapters: tuple[str, str] | None, tracking: bool
) -> KubeObject:
    k8s = recipe.k8s
    worker = k8s.worker_resources()
    resources = {"cpu": str(worker["cpu"]), "memory": str(worker["memory"])}
    non_root = profiles.PROFILES[k8s.profile].non_root
    container = {
        "command": command,
        "env": objects.worker_env(recipe, names),
        "envFrom": objects.tracking_env_from(recipe) if tracking else None,
        "image": k8s.container_image(),
        "imagePullPolicy": k8s.image_pull_policy,
        "name": CONTAINER,
        "resources": {"limits": resources, "requests": dict(resources)},
        "securityContext": profiles.container_security(k8s) if non_root else None,
        "volumeMounts": [objects.data_mount()]
        + ([{"name": "adapters", "mountPath": adapters[1], "subPath": ADAPTERS_SUBPATH}] if adapters else []),
    }
    return drop_none(container)


def export_job(
    recipe: Recipe,
    names: Names,
    job_name: str,
    command: list[str] | None = None,
    adapters: tuple[str, str] | None = None,
    tracking: bool = False,
) -> KubeObject:
    """`recipe` is the applied (resolved) recipe: its output_dir is on the claim. `command`: the
    merged export unless given; `adapters`: (a ModelServer's claim, where to mount its adapters);
    `tracking`: the trackers' envFrom (monitor.tracking_env_from), for a Job that registers."""
    k8s = recipe.k8s
    volumes = [objects.data_volume(names)]
    if adapters:
        volumes.append({"name": "adapters", "persistentVolumeClaim": {"claimName": adapters[0]}})
    pod = {
        "containers": [_container(recipe, names, command or export_command(recipe), adapters, tracking)],
        "nodeSelector": dict(k8s.node_selector) or None,
        "restartPolicy": "Never",
        "securityContext": profiles.pod_security(k8s),
        "serviceAccountName": k8s.service_account,
        "tolerations": profiles.tolerations(k8s),
        "volumes": volumes,
    }
    meta = objects.object_meta(names, job_name, CONTAINER)
    template = {"metadata": {"labels": dict(meta["labels"])}, "spec": drop_none(pod)}
    spec = {"backoffLimit": BACKOFF_LIMIT, "template": template}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}
