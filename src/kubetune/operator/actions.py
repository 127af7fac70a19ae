"""What the operator reads from and does to the cluster, through `KubeClient` (no kopf here).

Creating is idempotent: an object that exists already (409) counts as created, so a handler
retried after a crash or a temporary error finishes the job instead of failing on its first
half. Every object rendered for a FineTune is owned by it (`plan.owned`).
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass, field
from typing import Any

from kubetune.errors import RecipeError, UserError
from kubetune.k8s import doctor, follow
from kubetune.k8s.export_job import adapter_install_command, adapter_uninstall_command, export_command, export_job
from kubetune.k8s.modelserver import API_VERSION as MS_API_VERSION
from kubetune.k8s.modelserver import KIND as MS_KIND
from kubetune.k8s.modelserver import ModelServerSpec, server_recipe
from kubetune.k8s.names import Names, trainer_selector
from kubetune.k8s.objects import config_map_recipe, recipe_text_data
from kubetune.k8s.progress import Progress
from kubetune.k8s.render import render
from kubetune.k8s.serve.argv import API_KEY_SECRET_KEY
from kubetune.k8s.serve.render import render_serve
from kubetune.kubeapi import ClusterError, Conflict, KubeClient
from kubetune.operator import metrics_page, plan, serverplan
from kubetune.recipe.gated import missing_token_problem
from kubetune.recipe.schema import Recipe

JOB_KINDS = {"pytorchjob": ("kubeflow.org/v1", "PyTorchJob"), "trainjob": ("trainer.kubeflow.org/v1alpha1", "TrainJob")}


def meta(body: dict[str, Any]) -> tuple[str, str]:
    return body["metadata"]["name"], body["metadata"]["namespace"]


# ------------------------------------------------------------------ reading the spec


def spec_recipe(client: KubeClient, body: dict[str, Any], spec: plan.FineTuneSpec) -> Recipe:
    """spec.recipe, or the recipeRef ConfigMap's key, validated (RecipeError: every problem) and resolved.
    A gated model needs spec.hfTokenSecretRef: without it its pods could only fail with the Hub's 401."""
    name, namespace = meta(body)
    data = spec.recipe
    if spec.recipe_ref is not None:
        cm_name, key = spec.recipe_ref
        cm = client.get("v1", "ConfigMap", cm_name, namespace)
        if cm is None or key not in (cm.get("data") or {}):
            raise RecipeError(f"spec.recipeRef: ConfigMap {namespace}/{cm_name} has no key {key!r}")
        data = recipe_text_data(cm["data"][key], f"ConfigMap {cm_name} key {key}")
    if data is None:
        raise RecipeError("spec: set spec.recipe (the recipe inline) or spec.recipeRef (a ConfigMap key)")
    recipe = plan.resolved(plan.load_recipe_for(name, namespace, data, spec))  # as its ConfigMap will hold it
    if spec.hf_token_ref is None and (problem := missing_token_problem(recipe)):
        raise RecipeError(problem)
    return recipe


def applied_recipe(client: KubeClient, body: dict[str, Any]) -> Recipe | None:
    """The recipe the job runs (its ConfigMap), None before the first create."""
    name, namespace = meta(body)
    cm = client.get("v1", "ConfigMap", Names.for_job(name, namespace).recipe, namespace)
    return None if cm is None else config_map_recipe(cm)


class TokenSecretMissing(ClusterError):
    """spec.hfTokenSecretRef names a Secret (or key) that is not there (yet): temporary, since the
    Secret is often created after the FineTune that names it (`submit --via-operator` does so)."""


def hf_token(client: KubeClient, namespace: str, spec: plan.FineTuneSpec) -> str | None:
    if spec.hf_token_ref is None:
        return None
    secret_name, key = spec.hf_token_ref
    secret = client.get("v1", "Secret", secret_name, namespace)
    value = ((secret or {}).get("data") or {}).get(key)
    if value is None:
        what = f"has no key {key}" if secret is not None else "does not exist"
        raise TokenSecretMissing(
            f"spec.hfTokenSecretRef: Secret {namespace}/{secret_name} {what} (yet); create it with `kubectl create "
            f"secret generic {secret_name} -n {namespace} --from-file={key}=FILE` (the operator retries until then)"
        )
    return base64.b64decode(value).decode()


# ------------------------------------------------------------------ creating and deleting


def create_all(client: KubeClient, objects: list[dict[str, Any]]) -> list[str]:
    """Create each object unless it exists; `Kind/name` of those created now."""
    created = []
    for obj in objects:
        try:
            client.create(obj)
        except Conflict:
            continue
        created.append(f"{obj['kind']}/{obj['metadata']['name']}")
    return created


def training_objects(
    client: KubeClient, body: dict[str, Any], spec: plan.FineTuneSpec, recipe: Recipe
) -> list[dict[str, Any]]:
    """Everything `kubetune k8s render` makes for the recipe, owned by the FineTune."""
    token = hf_token(client, meta(body)[1], spec)
    return plan.owned(render(recipe, hf_token=token).objects, body, spec.delete_claim)


def create_training(client: KubeClient, body: dict[str, Any], spec: plan.FineTuneSpec, recipe: Recipe) -> list[str]:
    objects = training_objects(client, body, spec, recipe)
    if spec.suspend:  # everything but the job: resuming then only adds the job
        objects = [o for o in objects if o["kind"] not in plan.JOB_KINDS]
    return create_all(client, objects)


def delete_training(client: KubeClient, name: str, namespace: str) -> bool:
    """Delete the Kubeflow job; its pods go with it (they are the job's), the claim stays."""
    deleted = [client.delete(av, kind, name, namespace) for av, kind in JOB_KINDS.values()]  # both kinds, always
    return any(deleted)


def create_export(client: KubeClient, body: dict[str, Any], spec: plan.FineTuneSpec, recipe: Recipe) -> list[str]:
    """The export Job: merges (export.merged, or served alone), checks the gate, registers (export.register)."""
    name, namespace = meta(body)
    command = export_command(recipe, merged=spec.merges(), register=spec.register)
    registers = spec.register is not None
    job = export_job(recipe, Names.for_job(name, namespace), name + plan.EXPORT_SUFFIX, command, tracking=registers)
    return create_all(client, plan.owned([job], body, delete_claim=False))


def model_server(client: KubeClient, name: str, namespace: str) -> dict[str, Any] | None:
    return client.get(MS_API_VERSION, MS_KIND, name, namespace)


def server_api_key(client: KubeClient, server_body: dict[str, Any]) -> str | None:
    """The key a ModelServer's replicas require (its Secret's `api-key`, the first of a
    comma-separated list). The default Secret, `<name>-api-key`, is created here with a random key,
    owned by the server; a Secret the spec names and that is not there yet gives None (its pods
    cannot start without it either)."""
    name, namespace = meta(server_body)
    spec = ModelServerSpec.from_dict(server_body.get("spec") or {})
    secret = client.get("v1", "Secret", spec.key_secret(name), namespace)
    if secret is None and spec.api_key_secret is None:
        secret = _new_key_secret(spec.key_secret(name), namespace)
        create_all(client, plan.owned([secret], server_body, delete_claim=False))
    encoded = ((secret or {}).get("data") or {}).get(API_KEY_SECRET_KEY)
    if not encoded:
        return None
    return base64.b64decode(encoded).decode().split(",")[0].strip() or None


def _new_key_secret(name: str, namespace: str) -> dict[str, Any]:
    key = secrets.token_urlsafe(32)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "type": "Opaque",
        "data": {API_KEY_SECRET_KEY: base64.b64encode(key.encode()).decode()},
    }


def claim_version(
    client: KubeClient, server_body: dict[str, Any], finetune: str, adapter: str, taken: list[str]
) -> serverplan.AdapterRef:
    """The next free version of `adapter` on the server, reserved atomically: a ConfigMap per
    version, owned by the ModelServer (so a version is never given out twice while the server
    lives, even when two FineTunes finish at once or one was deleted with its files kept); the
    API server's 409 on create is the lock. A FineTune finds its own claim again on a retry."""
    server_name, namespace = meta(server_body)
    spec = ModelServerSpec.from_dict(server_body.get("spec") or {})
    versions = list(taken)
    while True:
        ref = serverplan.new_adapter(server_name, adapter, versions, spec)
        claim = serverplan.version_claim(server_name, namespace, ref, finetune)
        try:
            client.create(plan.owned([claim], server_body, delete_claim=False)[0])
            return ref
        except Conflict:
            held = client.get("v1", "ConfigMap", claim["metadata"]["name"], namespace)
            if ((held or {}).get("data") or {}).get("finetune") == finetune:
                return ref
        versions.append(ref.version)


def create_adapter_export(
    client: KubeClient,
    body: dict[str, Any],
    spec: plan.FineTuneSpec,
    recipe: Recipe,
    ref: serverplan.AdapterRef,
    server: ModelServerSpec,
) -> list[str]:
    """The Job that copies the run's adapter (not merged) into the server's volume and registers it
    there (and, with spec.export.register, in that model registry)."""
    name, namespace = meta(body)
    at = (server.base, server.revision, server.mount_path)
    command = adapter_install_command(recipe, ref.name, ref.version, *at, register=spec.register)
    claim = Names.for_job(ref.server, namespace).pvc
    job = export_job(
        recipe,
        Names.for_job(name, namespace),
        name + serverplan.ADAPTER_EXPORT_SUFFIX,
        command=command,
        adapters=(claim, server.mount_path),
        tracking=spec.register is not None,
    )
    return create_all(client, plan.owned([job], body, delete_claim=False))


def create_unregister(
    client: KubeClient, server_body: dict[str, Any], ref: serverplan.AdapterRef, finetune: str
) -> list[str]:
    """The Job that takes a deleted FineTune's adapter out of the server's registry (and, with
    adapterStorage.retention Delete, its files): owned by the ModelServer, which outlives it."""
    server_name, namespace = meta(server_body)
    spec = ModelServerSpec.from_dict(server_body.get("spec") or {})
    recipe = server_recipe(server_name, namespace, spec)
    command = adapter_uninstall_command(ref.name, ref.version, delete_files=spec.retention == "Delete")
    job_name = f"{finetune}-{ref.version}{serverplan.UNREGISTER_SUFFIX}"[:63].rstrip("-")
    job = export_job(recipe, Names.for_job(server_name, namespace), job_name, command=command)
    return create_all(client, plan.owned([job], server_body, delete_claim=False))


def serving_objects(body: dict[str, Any], spec: plan.FineTuneSpec, recipe: Recipe) -> list[dict[str, Any]]:
    """What `kubetune k8s render-serve` makes for the run, owned by the FineTune. No token: the
    serving pods read the training job's Secret, which `training_objects` made."""
    return plan.owned(render_serve(recipe, spec.serve.settings).objects, body, False)


# ------------------------------------------------------------------ observing


@dataclass
class Observation:
    recipe: Recipe
    job: dict[str, Any] | None
    pods: list[dict[str, Any]] = field(default_factory=list)
    export_job: dict[str, Any] | None = None
    serving: dict[str, Any] | None = None  # the serving Deployment
    server: dict[str, Any] | None = None  # spec.serve.server's ModelServer
    adapter_export_job: dict[str, Any] | None = None
    export_pods: list[dict[str, Any]] = field(default_factory=list)  # the gate's verdict is in their messages

    @property
    def restarts(self) -> int:
        return sum(
            cs.get("restartCount", 0)
            for pod in self.pods
            for cs in (pod.get("status") or {}).get("containerStatuses") or []
        )


def observe(client: KubeClient, body: dict[str, Any], recipe: Recipe, server: str | None = None) -> Observation:
    name, namespace = meta(body)
    api_version, kind = JOB_KINDS[recipe.k8s.api]
    job = client.get(api_version, kind, name, namespace)
    pods = client.list("v1", "Pod", namespace, trainer_selector(name)) if job else []
    export_name = name + plan.EXPORT_SUFFIX
    export_job = client.get("batch/v1", "Job", export_name, namespace)
    adapter_export_name = name + serverplan.ADAPTER_EXPORT_SUFFIX
    adapter_export_job = client.get("batch/v1", "Job", adapter_export_name, namespace) if server else None
    # the gate's verdict is the termination message of whichever export ran (merged or adapter)
    export_pods = [
        pod
        for job_name, found in ((export_name, export_job), (adapter_export_name, adapter_export_job))
        if found
        for pod in client.list("v1", "Pod", namespace, {"job-name": job_name})
    ]
    return Observation(
        recipe=recipe,
        job=job,
        pods=pods,
        export_job=export_job,
        serving=client.get("apps/v1", "Deployment", f"{name}-serve", namespace),
        server=model_server(client, server, namespace) if server else None,
        adapter_export_job=adapter_export_job,
        export_pods=export_pods,
    )


def read_progress(
    client: KubeClient, name: str, namespace: str, seen: Observation
) -> tuple[Progress, float | None] | None:
    """Rank 0's progress: its metrics endpoint when it serves one, else its log (or metrics.jsonl)."""
    if seen.job is None:
        return None
    rank0 = next((p for p in seen.pods if follow.pod_rank(p, follow.has_master(seen.job)) == 0), None)
    url = metrics_page.metrics_url(rank0) if rank0 else None
    text = metrics_page.fetch_metrics(url) if url else None
    if text:
        found, eval_loss = metrics_page.from_metrics_text(text)
        if found is not None:
            return found, eval_loss
    logged = follow.read_progress(
        client, name, namespace, seen.job, follow.trainer_pods(client, name, namespace, seen.job)
    )
    return None if logged is None else (logged, None)


def diagnosis(client: KubeClient, name: str, namespace: str) -> list[str]:
    """`kubetune k8s doctor`'s errors and warnings, one line each (problem, then the fix)."""
    try:
        findings = doctor.diagnose(doctor.collect(client, name, namespace))
    except UserError as e:  # the cluster did not answer: say so instead of a diagnosis
        return [f"no diagnosis: {e.problems[0]}"]
    return [f"{f.subject}: {f.problem}; fix: {f.fix}" for f in findings if f.severity in ("error", "warning")]
