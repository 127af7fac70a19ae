"""The ModelServer object (kubetune.io/v1alpha1): one shared server per base model that serves
many tuned adapters, and its objects (pure). The CRD and the operator that acts on it live in
`kubetune.operator`.

A ModelServer renders what `render-serve` renders for a run, from the same builders, with the
base model as the served target and the adapter volume mounted: its volume claim `<name>-data`
(the base model's cache at /data, the adapters at /adapters = the claim's adapters/), the
Deployment (`kubetune serve BASE --allow-runtime-adapters --adapter-registry
/adapters/registry.json --max-loras K`), Service, PodDisruptionBudget, [HPA], and for a gateway
the InferencePool and one InferenceObjective per served adapter (`kubetune.k8s.serve.gateway`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kubetune.contracts.adapter_volume import ROOT as ADAPTER_ROOT
from kubetune.contracts.kube import KubeObject
from kubetune.k8s import objects
from kubetune.k8s.finetune import API_VERSION, GROUP, VERSION
from kubetune.k8s.names import Names
from kubetune.k8s.serve.autoscale import adapter_rule_config_map, autoscaler
from kubetune.k8s.serve.deployment import deployment, disruption_budget
from kubetune.k8s.serve.gateway import inference_objective, inference_pool
from kubetune.k8s.serve.network import network_policy, service
from kubetune.k8s.serve.plan import AdapterServing, Plan, plan_for
from kubetune.k8s.serve.settings import AUTOSCALE, ServeSettings
from kubetune.recipe.loader import recipe_from_data
from kubetune.recipe.schema import Recipe

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "ModelServerSpec", "render_model_server"]

KIND = "ModelServer"
API_KEY_SUFFIX = "-api-key"
PLURAL = "modelservers"
RETENTION = ("Retain", "Delete")
ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce")


@dataclass(frozen=True)
class ModelServerSpec:
    """spec of a ModelServer, defaults applied."""

    base: str
    revision: str | None = None
    profile: str = "cpu"
    engine: str = "native"
    image: str | None = None
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    autoscale: str = "off"
    max_loras: int = 8
    storage_size: str = "50Gi"
    storage_class: str | None = None
    access_mode: str = "ReadWriteMany"
    retention: str = "Retain"  # the adapter files when their FineTune goes
    mount_path: str = ADAPTER_ROOT  # where replicas and export Jobs see the adapters
    gateway: bool = True
    endpoint_picker: str | None = None
    weights: dict[str, dict[str, int]] = field(default_factory=dict)  # alias -> version -> percent
    api_key_secret: str | None = None  # the Secret of the replicas' API key; None: the operator makes <name>-api-key

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> ModelServerSpec:
        base = spec.get("base") or {}
        storage = spec.get("adapterStorage") or {}
        autoscaling = spec.get("autoscaling") or {}
        gateway = spec.get("gateway") or {}
        return cls(
            base=base.get("model", ""),
            revision=base.get("revision"),
            profile=spec.get("profile", "cpu"),
            engine=spec.get("engine", "native"),
            image=spec.get("image"),
            replicas=spec.get("replicas", 1),
            min_replicas=autoscaling.get("minReplicas"),
            max_replicas=autoscaling.get("maxReplicas"),
            autoscale=autoscaling.get("metric", "off"),
            max_loras=spec.get("maxLoras", 8),
            storage_size=storage.get("size", "50Gi"),
            storage_class=storage.get("storageClassName"),
            access_mode=storage.get("accessMode", "ReadWriteMany"),
            retention=storage.get("retention", "Retain"),
            mount_path=storage.get("mountPath", ADAPTER_ROOT),
            gateway=gateway.get("enabled", True),
            endpoint_picker=gateway.get("endpointPicker"),
            weights={a: dict(w) for a, w in (spec.get("weights") or {}).items()},
            api_key_secret=spec.get("apiKeySecret"),
        )

    def key_secret(self, name: str) -> str:
        """The Secret whose `api-key` the replicas require of every request, the operator's too."""
        return self.api_key_secret or f"{name}{API_KEY_SUFFIX}"

    def base_label(self) -> str:
        return f"{self.base}@{self.revision or 'default'}"

    def problems(self) -> list[str]:
        out = []
        if not self.base:
            out.append("spec.base.model: the base model every adapter was trained on (a hub id or a path under /data)")
        if self.autoscale not in AUTOSCALE:
            out.append(f"spec.autoscaling.metric {self.autoscale}: use queue, cpu or off")
        if self.max_loras < 1:
            out.append(f"spec.maxLoras {self.max_loras}: adapters resident at once per replica, at least 1")
        for alias, weights in self.weights.items():
            if sum(weights.values()) != 100:
                out.append(f"spec.weights.{alias}: the versions' weights add up to 100 (got {sum(weights.values())})")
        return out


def server_recipe(name: str, namespace: str, spec: ModelServerSpec) -> Recipe:
    """The recipe the serving builders read: the base model, the profile and the claim."""
    storage = {"size": spec.storage_size, "storage_class": spec.storage_class, "access_mode": spec.access_mode}
    data = {
        "model": {"name_or_path": spec.base, "revision": spec.revision},
        "k8s": {"name": name, "namespace": namespace, "profile": spec.profile, "storage": storage},
    }
    return recipe_from_data(data).recipe


def server_plan(name: str, namespace: str, spec: ModelServerSpec) -> Plan:
    settings = ServeSettings(
        engine=spec.engine,
        replicas=spec.replicas,
        min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        autoscale=spec.autoscale,
        image=spec.image,
        name=name,
        api_key_secret=spec.key_secret(name),
    )
    plan = plan_for(server_recipe(name, namespace, spec), settings, None)
    # the served target is the base model itself (a hub id, or a path the pod sees)
    shared = AdapterServing(spec.max_loras, registry=f"{spec.mount_path}/registry.json", root=spec.mount_path)
    return dataclasses.replace(plan, run_dir=spec.base, adapter_serving=shared)


def served_adapters(status: dict[str, Any]) -> list[str]:
    """The served names (`NAME@vN`, and each alias NAME) a ModelServer's status lists."""
    names: list[str] = []
    for entry in status.get("adapters") or []:
        for served in (entry["name"], entry["servedName"]):
            if served not in names:
                names.append(served)
    return names


def gateway_objects(plan: Plan, spec: ModelServerSpec, adapters: list[str]) -> list[KubeObject]:
    if not spec.gateway:
        return []
    return [inference_pool(plan, spec.endpoint_picker)] + [inference_objective(plan, a) for a in adapters]


def render_model_server(name: str, namespace: str, spec: ModelServerSpec, adapters: list[str]) -> list[KubeObject]:
    """The ModelServer's objects in apply order; `adapters`: the served names of its status."""
    plan = server_plan(name, namespace, spec)
    out = [objects.pvc(plan.k8s, Names.for_job(name, namespace)), network_policy(plan)]
    if spec.autoscale == "queue":
        out.append(adapter_rule_config_map(plan))
    out += [deployment(plan), service(plan), disruption_budget(plan)]
    if spec.autoscale != "off":
        out.append(autoscaler(plan))
    return out + gateway_objects(plan, spec, adapters)
