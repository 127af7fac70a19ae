"""What the serving objects share, worked out once: the source (a run directory or a recipe),
the serving names, where the pods read the run, and the model's size for the start-up budget."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from kubetune.contracts.adapter_volume import REGISTRY_FILE
from kubetune.contracts.adapter_volume import ROOT as ADAPTER_ROOT
from kubetune.contracts.kube import KubeObject
from kubetune.errors import UserError
from kubetune.k8s.names import DATA_DIR, SERVE_SUFFIX, SERVER_COMPONENT, Names, server_selector, standard_labels
from kubetune.k8s.render import cluster_recipe, job_name
from kubetune.k8s.serve.settings import DNS_1035, ServeSettings, default_engine
from kubetune.recipe.k8s import K8sSection
from kubetune.recipe.loader import load_recipe
from kubetune.recipe.schema import DEFAULT_MODEL, Recipe
from kubetune.rundir import RunDir

PORT_NAME = "http"  # the Service's port, which probes and the Ingress name
# --model-image: the image holds the run directory here; an init container copies it into an
# emptyDir at MODELS_DIR, where the server reads it (and caches what it downloads).
MODEL_IMAGE_DIR = "/model"
MODELS_DIR = "/models"
# Start-up budget: the startup probe allows this long before liveness takes over (a pod killed
# while its model loads starts the load over). bf16 weights read from a network volume at
# ~35 MB/s under load, plus the process start and a first warm-up; vLLM on Gaudi also compiles
# an HPU graph per bucket before it serves.
LOAD_BASE_S = 300
LOAD_S_PER_GIB = 30
UNKNOWN_LOAD_S = 1800
GAUDI_VLLM_WARMUP_S = 1200
_SIZE = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)([bm])(?![a-z0-9])")


def load_source(source: str, overrides: list[str]) -> tuple[Recipe, Path | None]:
    """RUN|RECIPE -> (recipe, the local run directory or None). A directory is a run that
    `kubetune train` wrote (its recipe.yaml, read without torch); anything else a recipe
    (file or builtin name), whose run is where its training job writes `output_dir`."""
    path = Path(source).expanduser()
    if path.is_dir():
        run = RunDir(path)
        recipe = run.recipe(overrides)
        run.finished_weights(recipe)
        return recipe, path
    return load_recipe(source, overrides).recipe, None


def model_params(name_or_path: str) -> int | None:
    """Parameters read from the model's name (`Llama-2-7b-chat-hf` 7e9, `smollm2-135m-instruct`
    135e6), None when its name does not say."""
    name = PurePosixPath(name_or_path.rstrip("/")).name.lower().replace("_", "-")
    found = _SIZE.findall(name)
    if not found:
        return None
    number, unit = found[-1]
    return int(float(number) * (1e9 if unit == "b" else 1e6))


def startup_seconds(params: int | None, engine: str, profile: str) -> int:
    """How long a pod may take to load the model before liveness checks begin."""
    if params is None:
        seconds = UNKNOWN_LOAD_S
    else:
        seconds = LOAD_BASE_S + math.ceil(params * 2 / 2**30 * LOAD_S_PER_GIB)
    if engine == "vllm" and profile == "gaudi":
        seconds += GAUDI_VLLM_WARMUP_S
    return seconds


def is_gguf(name_or_path: str) -> bool:
    return name_or_path == DEFAULT_MODEL or name_or_path.lower().endswith(".gguf")


@dataclass(frozen=True)
class AdapterServing:
    """A shared server (a ModelServer): the base model served with runtime adapters, which it
    reads from the adapter volume (`kubetune.contracts.adapters`) mounted at /adapters."""

    max_loras: int
    registry: str = REGISTRY_FILE
    root: str = ADAPTER_ROOT


@dataclass
class Plan:
    """What the objects share, worked out once."""

    recipe: Recipe
    settings: ServeSettings
    names: Names  # the serving instance (its name)
    job: Names  # the training job (its claim, its token Secret)
    run_dir: str  # the run directory as the server sees it
    root: str  # where relative --adapter paths and caches live: /data (claim) or /models (image)
    params: int | None
    warnings: list[str] = field(default_factory=list)
    # GRPO's rollout server (k8s/serve/rollout.py): the recipe's base model with runtime adapters,
    # the claim read-only (the trainer writes the adapters there), caches in the pod's own emptyDir
    rollout: bool = False
    adapter_serving: AdapterServing | None = None  # a ModelServer's replicas

    @property
    def k8s(self) -> K8sSection:
        return self.recipe.k8s

    @property
    def engine(self) -> str:
        return self.settings.engine or default_engine(self.k8s.profile)

    @property
    def labels(self) -> dict[str, str]:
        return standard_labels(self.names, SERVER_COMPONENT)

    @property
    def selector(self) -> dict[str, str]:
        return server_selector(self.names.job)

    def meta(self, name: str, component: str = SERVER_COMPONENT, **extra: Any) -> KubeObject:
        meta: KubeObject = {
            "name": name,
            "namespace": self.names.namespace,
            "labels": standard_labels(self.names, component),
        }
        return {**meta, **extra}


def plan_for(recipe: Recipe, settings: ServeSettings, local_run: Path | None) -> Plan:
    k8s = recipe.k8s
    job = Names.for_job(job_name(recipe), k8s.namespace, k8s.storage.existing_claim)
    name = settings.name or f"{job.job}{SERVE_SUFFIX}"
    if len(name) > 63 or not DNS_1035.match(name):
        raise UserError(
            f"the serving name {name!r} is not a DNS-1035 label (a lower-case letter first, at most 63): "
            "give one with --name"
        )
    names = Names.for_job(name, k8s.namespace)
    if settings.model_image:
        root = MODELS_DIR
        run_dir = f"{MODELS_DIR}/{job.job}"
    else:
        root = DATA_DIR
        run_dir = cluster_recipe(recipe, job).output_dir
    plan = Plan(recipe, settings, names, job, run_dir, root, model_params(recipe.model.name_or_path))
    if local_run is not None:
        where = (
            f"the image {settings.model_image} at {MODEL_IMAGE_DIR}"
            if settings.model_image
            else f"claim {job.pvc} at {run_dir} (`kubectl cp {local_run} {k8s.namespace}/{job.data_pod}:{run_dir}`)"
        )
        plan.warnings.append(f"{local_run} is a local run: the pods read it from {where}; put it there first")
    return plan
