"""The operator's decisions, pure: a FineTune's spec -> the recipe; rendered objects -> objects
owned by the FineTune; what was observed in the cluster -> the next phase, the actions that
lead there, and the status to write. No kopf, no API calls: `handlers.py` observes and acts.

The applied recipe is the one in the job's ConfigMap (`<name>-recipe`), written on create:
resuming, exporting and serving render from it, so an edit of `spec.recipe` that was refused
(it would change what is learned) never reaches the pods.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kubetune.contracts.gate import (
    REGISTRIES,
    read_gate_message,
    read_lm_eval_message,
    read_register_error_message,
    read_registered_message,
)
from kubetune.contracts.kube import KubeObject, drop_none
from kubetune.errors import RecipeError
from kubetune.k8s.export_job import Register
from kubetune.k8s.names import NAMESPACE_QUOTA, RECIPE_KEY, TOKEN_KEY, Names
from kubetune.k8s.progress import Progress, format_eta
from kubetune.k8s.render import cluster_recipe, recipe_problems
from kubetune.k8s.serve import ServeSettings
from kubetune.operator.crd import API_VERSION, KIND
from kubetune.recipe.loader import recipe_from_data
from kubetune.recipe.schema import Recipe
from kubetune.rundir import RunDir

JOB_KINDS = {"PyTorchJob", "TrainJob"}
CLUSTER_SCOPED = {"Namespace", "PriorityClass", "ClusterTrainingRuntime"}
SUCCEEDED = {"Succeeded", "Complete"}  # PyTorchJob's and TrainJob's words for it
RUNNING = {"Running", "Restarting"}
TRAINED_PHASES = {"Exporting", "Serving", "Succeeded"}
EXPORT_SUFFIX = "-export"


# ------------------------------------------------------------------ the spec


@dataclass(frozen=True)
class ServeSpec:
    """spec.serve: whether to serve, and render-serve's settings for it (the keys ServeSettings names)."""

    enabled: bool = False
    settings: ServeSettings = field(default_factory=ServeSettings)
    server: str | None = None  # a ModelServer: the adapter is exported into it and served there
    adapter_name: str | None = None  # its name there (default: the FineTune's)

    @classmethod
    def from_dict(cls, serve: dict[str, Any]) -> ServeSpec:
        return cls(
            bool(serve.get("enabled", False)),
            ServeSettings.from_spec(serve),
            serve.get("server"),
            serve.get("adapterName"),
        )


@dataclass(frozen=True)
class FineTuneSpec:
    """spec of a FineTune, defaults applied (the CRD leaves defaults to this, like the recipe's)."""

    recipe: dict[str, Any] | None = None
    recipe_ref: tuple[str, str] | None = None  # (ConfigMap, key)
    profile: str | None = None
    api: str | None = None
    hf_token_ref: tuple[str, str] | None = None  # (Secret, key)
    serve: ServeSpec = ServeSpec()
    export_merged: bool = False
    register: Register | None = None  # spec.export.register: the export Job registers the model
    suspend: bool = False
    ttl_seconds: int | None = None
    delete_claim: bool = False

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> FineTuneSpec:
        serve = spec.get("serve") or {}
        export = spec.get("export") or {}
        return cls(
            recipe=spec.get("recipe"),
            recipe_ref=_key_ref(spec.get("recipeRef"), RECIPE_KEY),
            profile=spec.get("profile"),
            api=spec.get("api"),
            hf_token_ref=_key_ref(spec.get("hfTokenSecretRef"), TOKEN_KEY),
            serve=ServeSpec.from_dict(serve),
            export_merged=bool(export.get("merged", False)),
            register=_register(export),
            suspend=bool(spec.get("suspend", False)),
            ttl_seconds=spec.get("ttlSecondsAfterFinished"),
            delete_claim=spec.get("volumeClaimRetention", "Retain") == "Delete",
        )

    def export_wanted(self, recipe: Recipe) -> bool:
        # a full fine-tune's model/ is already whole: only LoRA has something to merge; a shared
        # server (spec.serve.server) takes the adapter as it is, and its adapter-export Job checks
        # the gate (and registers). A gated full run to be served still gets the Job, which only
        # checks the gate; a run to register gets it too, which registers what it exported.
        gated = self.own_server and recipe.eval.gate is not None
        registers = self.register is not None and not self.serve.server
        merged_job = (self.own_server or self.export_merged) and (recipe.finetune.method == "lora" or gated)
        return registers or merged_job

    @property
    def own_server(self) -> bool:
        return self.serve.enabled and not self.serve.server

    def merges(self) -> bool:
        """The export Job merges a LoRA run (export.merged, or served alone); else, when it
        registers, it registers the adapter as it is."""
        return self.export_merged or self.own_server

    def register_problems(self, recipe: Recipe) -> list[str]:
        """spec.export's registry keys that cannot work, one line each naming the key."""
        r = self.register
        if r is None:
            return []
        tracking = recipe.monitor.tracking_env_from
        wrong = {
            "spec.export.registeredName and registryUrl go with spec.export.register (mlflow or kubeflow)": (
                not r.registry
            ),
            f"spec.export.register: {r.registry!r} is not a registry kubetune knows; use one of "
            f"{', '.join(REGISTRIES)}": bool(r.registry) and r.registry not in REGISTRIES,
            "spec.export.registryUrl: register kubeflow needs the Model Registry's address "
            "(e.g. https://model-registry-service.kubeflow.svc:8443)": r.registry == "kubeflow" and not r.url,
            "spec.export.registryUrl: goes with register kubeflow; MLflow's server is the MLFLOW_TRACKING_URI "
            "of the recipe's monitor.tracking_env_from": r.registry == "mlflow" and bool(r.url),
            "spec.export.register: mlflow reads MLFLOW_TRACKING_URI from the recipe's monitor.tracking_env_from "
            "(a Secret or ConfigMap the export Job gets as envFrom); set it": r.registry == "mlflow"
            and not (tracking.secret or tracking.config_map),
        }
        return [problem for problem, found in wrong.items() if found]


def _register(export: dict[str, Any]) -> Register | None:
    """spec.export.register and its keys; registeredName / registryUrl alone are kept as a
    registry of "" (refused by `register_problems`, naming the key)."""
    name, url = export.get("registeredName") or None, export.get("registryUrl") or None
    if export.get("register"):
        return Register(export["register"], name, url)
    return Register("", name, url) if name or url else None


def _key_ref(ref: dict[str, Any] | None, default_key: str) -> tuple[str, str] | None:
    return (ref["name"], ref.get("key") or default_key) if ref else None


def load_recipe_for(name: str, namespace: str, data: dict[str, Any], spec: FineTuneSpec) -> Recipe:
    """The FineTune's recipe, validated by the CLI's loader and checked as `k8s render` checks it.
    The job is named after the FineTune and lives in its namespace (owner references cannot
    cross namespaces); spec.profile / spec.api override the recipe's. Every problem, one line each."""
    data = copy.deepcopy(data)
    k8s = data.setdefault("k8s", {})
    problems = []
    if isinstance(k8s, dict):
        for key, must in (("namespace", namespace), ("name", name)):
            if k8s.get(key) not in (None, must):
                problems.append(
                    f"`k8s.{key}`: a FineTune's objects are named and placed by the FineTune ({must!r}, "
                    f"not {k8s[key]!r}); remove the key"
                )
        k8s.update({"namespace": namespace, "name": name})
        k8s.update({k: v for k, v in (("profile", spec.profile), ("api", spec.api)) if v})
    try:
        recipe = recipe_from_data(data).recipe
    except RecipeError as e:
        raise RecipeError(*problems, *e.problems) from None
    problems += recipe_problems(recipe)
    if spec.serve.server and recipe.finetune.method != "lora":
        problems.append(
            f"spec.serve.server: a ModelServer serves LoRA adapters, and finetune.method is "
            f"{recipe.finetune.method}; set finetune.method: lora, or serve it alone with spec.serve.enabled"
        )
    problems += spec.register_problems(recipe)
    if spec.serve.enabled:
        # the settings speak in render-serve's flags (--max-replicas): say spec.serve's words
        problems += [f"spec.serve: {p.replace('--', '')}" for p in spec.serve.settings.problems()]
    if problems:
        raise RecipeError(*problems)
    return recipe


def resolved(recipe: Recipe) -> Recipe:
    """The recipe as its ConfigMap holds it (output_dir on the claim), for comparing with it."""
    return cluster_recipe(recipe, Names.for_job(recipe.k8s.name or "", recipe.k8s.namespace))


# ------------------------------------------------------------------ ownership


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": owner.get("apiVersion", API_VERSION),  # a FineTune, or a ModelServer
        "kind": owner.get("kind", KIND),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned(objects: list[KubeObject], owner: dict[str, Any], delete_claim: bool) -> list[KubeObject]:
    """The rendered objects the operator creates, each owned by the FineTune (so that deleting it
    deletes them: Kubernetes' garbage collector), except what must outlive it or is shared: the
    Namespace (it exists already), cluster-scoped objects (a namespaced owner cannot own them),
    the namespace's shared quota, and the volume claim unless spec.volumeClaimRetention is Delete."""
    out = []
    for obj in objects:
        if obj["kind"] == "Namespace":
            continue
        obj = copy.deepcopy(obj)
        shared = obj["kind"] == "ResourceQuota" and obj["metadata"]["name"] == NAMESPACE_QUOTA
        kept_claim = obj["kind"] == "PersistentVolumeClaim" and not delete_claim
        if obj["kind"] not in CLUSTER_SCOPED and not shared and not kept_claim:
            obj["metadata"]["ownerReferences"] = [owner_reference(owner)]
        out.append(obj)
    return out


# ------------------------------------------------------------------ observed state -> next phase


@dataclass(frozen=True)
class Observed:
    suspend: bool
    trained: bool  # training succeeded before (the job may be gone: TTL, suspend after success)
    failed_before: bool  # the last phase was Failed
    job_exists: bool
    job_state: str | None  # the job's newest condition that holds
    export_wanted: bool
    export_state: str | None  # None (no export Job) | Running | Complete | Failed
    serve_enabled: bool
    serving: bool  # the serving Deployment exists
    adapter_server: str | None = None  # spec.serve.server
    server_found: bool = True  # that ModelServer exists
    base_mismatch: str | None = None  # why the adapter does not fit the server's base
    adapter_export_state: str | None = None  # the adapter-export Job, as export_state reads a Job
    gate: dict[str, Any] | None = None  # the eval gate's verdict, from the export pod (contracts/gate.py)
    register_error: str | None = None  # why the export pod could not register the model (spec.export.register)


@dataclass(frozen=True)
class Step:
    phase: str
    actions: tuple[str, ...] = ()  # create-training | delete-training | create-export | create-serving |
    # create-adapter-export | register-adapter


def next_step(o: Observed) -> Step:
    if o.trained or o.job_state in SUCCEEDED:
        return _after_training(o)
    if o.suspend:  # also how a Failed run is retried: suspend, then resume from its checkpoint
        return Step("Suspended", ("delete-training",) if o.job_exists else ())
    if o.job_state == "Failed" or (o.failed_before and not o.job_exists):
        return Step("Failed")
    if not o.job_exists:
        return Step("Pending", ("create-training",))
    return Step("Running" if o.job_state in RUNNING else "Pending")


def _after_training(o: Observed) -> Step:
    if o.export_wanted and o.export_state != "Complete":
        if o.export_state == "Failed":
            return Step("Failed")
        return Step("Exporting", () if o.export_state else ("create-export",))
    if o.gate is not None and not o.gate["passed"]:
        return Step("Succeeded")  # trained and saved; not served (the GatePassed condition says why)
    if o.adapter_server:
        return _to_server(o)
    if o.serve_enabled:
        return Step("Serving", () if o.serving else ("create-serving",))
    return Step("Succeeded")


def _to_server(o: Observed) -> Step:
    """spec.serve.server: the adapter is exported into the server's volume and registered there,
    then the server's replicas load it (the ModelServer's timer); refused for another base."""
    if not o.server_found:
        return Step("Exporting")  # waits for the ModelServer; the condition names it
    if o.base_mismatch:
        return Step("Failed")
    if o.adapter_export_state == "Failed":
        return Step("Failed")
    if o.adapter_export_state != "Complete":
        return Step("Exporting", () if o.adapter_export_state else ("create-adapter-export",))
    return Step("Serving", ("register-adapter",))


def gate_verdict(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The eval gate's verdict in the termination message of an export pod that ended, or None."""
    return next((v for v in map(read_gate_message, _termination_messages(pods)) if v is not None), None)


def lm_eval_results(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """lm-eval's base vs tuned table in an export pod's termination message, or None."""
    return next((t for t in map(read_lm_eval_message, _termination_messages(pods)) if t is not None), None)


def registered_model(pods: list[dict[str, Any]]) -> dict[str, str] | None:
    """What an export pod registered (spec.export.register): {registry, name, version[, uri]}, or None."""
    return next((r for r in map(read_registered_message, _termination_messages(pods)) if r is not None), None)


def register_error(pods: list[dict[str, Any]]) -> str | None:
    """Why an export pod's registration failed (one line), or None."""
    return next((e for e in map(read_register_error_message, _termination_messages(pods)) if e is not None), None)


def _termination_messages(pods: list[dict[str, Any]]) -> list[str | None]:
    return [
        ((cs.get("state") or {}).get("terminated") or {}).get("message")
        for pod in pods
        for cs in (pod.get("status") or {}).get("containerStatuses") or []
    ]


def job_state(job: dict[str, Any] | None) -> str | None:
    """The newest condition that holds (Created, Running, Restarting, Succeeded, Failed, Complete)."""
    conditions = [c for c in ((job or {}).get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    return conditions[-1]["type"] if conditions else None


def export_state(job: dict[str, Any] | None) -> str | None:
    if job is None:
        return None
    status = job.get("status") or {}
    if status.get("succeeded"):
        return "Complete"
    if any(c.get("type") == "Failed" and c.get("status") == "True" for c in status.get("conditions") or []):
        return "Failed"
    return "Running"


def finished_at(job: dict[str, Any] | None) -> datetime | None:
    """When the job succeeded or failed (its condition's lastTransitionTime)."""
    for c in ((job or {}).get("status") or {}).get("conditions") or []:
        if c.get("status") == "True" and c.get("type") in SUCCEEDED | {"Failed"} and c.get("lastTransitionTime"):
            return parse_time(c["lastTransitionTime"])
    return None


def ttl_expired(job: dict[str, Any] | None, ttl_seconds: int | None, now: datetime) -> bool:
    end = finished_at(job)
    return ttl_seconds is not None and end is not None and (now - end).total_seconds() >= ttl_seconds


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def now_text(now: datetime | None = None) -> str:
    return (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------ status


def progress_status(p: Progress, eval_loss: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "step": p.step,
        "totalSteps": p.total_steps,
        "percent": int(100 * p.fraction),
        "loss": _finite(p.loss),
        "evalLoss": _finite(eval_loss),
        "tokensPerSecond": _finite(p.tokens_per_s),
    }
    if p.step >= p.total_steps > 0:
        out.update(etaSeconds=0, eta="done")
    elif p.eta_s is not None and math.isfinite(p.eta_s):
        out.update(etaSeconds=int(p.eta_s), eta=format_eta(p.eta_s))
    return drop_none(out)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def condition(kind: str, status: bool, reason: str, message: str = "", generation: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": kind, "status": "True" if status else "False", "reason": reason, "message": message}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def with_condition(conditions: list[dict[str, Any]], new: dict[str, Any], now: str) -> list[dict[str, Any]]:
    """conditions with `new` in place of its type; the transition time moves only when status changes."""
    old = next((c for c in conditions if c.get("type") == new["type"]), None)
    stamped = {**new, "lastTransitionTime": now}
    if old is not None and old.get("status") == new["status"]:
        stamped["lastTransitionTime"] = old.get("lastTransitionTime", now)
    return [c for c in conditions if c.get("type") != new["type"]] + [stamped]


def artifacts(recipe: Recipe, claim: str, export_wanted: bool) -> dict[str, str]:
    run = RunDir(Path(recipe.output_dir))  # a path in the pods (the operator runs on Linux too)
    out = {"claim": claim, "runDir": recipe.output_dir, "adapter": str(run.weights(recipe.finetune.method))}
    if export_wanted and recipe.finetune.method == "lora":
        out["merged"] = str(run.merged)
    return out


def endpoint(serving_objects: list[KubeObject]) -> str | None:
    """The served OpenAI base URL: the Ingress host when set, else the Service inside the cluster."""
    for obj in serving_objects:
        rules = (obj.get("spec") or {}).get("rules") or []
        if obj["kind"] == "Ingress" and rules and rules[0].get("host"):
            return f"http://{rules[0]['host']}/v1"
    for obj in serving_objects:
        if obj["kind"] == "Service":
            meta, port = obj["metadata"], obj["spec"]["ports"][0]["port"]
            return f"http://{meta['name']}.{meta['namespace']}.svc:{port}/v1"
    return None
