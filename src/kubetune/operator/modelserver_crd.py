"""The ModelServer CustomResourceDefinition (kubetune.io/v1alpha1), written out (no recipe to
generate it from): one shared server per base model, serving the adapters FineTunes export into
it (`kubetune.k8s.modelserver`). Structural and closed like the FineTune's: under strict field
validation the API server rejects an unknown key; `check_model_server` checks an object the
way the API server would (tests, the chart)."""

from __future__ import annotations

from typing import Any

import yaml

from kubetune.k8s.modelserver import ACCESS_MODES, GROUP, KIND, PLURAL, RETENTION, VERSION
from kubetune.k8s.serve.settings import AUTOSCALE
from kubetune.operator.crd import PROFILES, Schema, _int, _obj, _str, condition_schema, schema_problems

CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILE = f"{CRD_NAME}.yaml"
PHASES = ("Pending", "Ready", "Degraded")


def spec_schema() -> Schema:
    storage = _obj(
        "The adapter volume: a claim `<name>-data`, the adapters under its adapters/ (mounted at /adapters).",
        {
            "size": _str("Claim size (default 50Gi)."),
            "storageClassName": _str("StorageClass (default: the cluster's)."),
            "accessMode": _str("ReadWriteMany (default: replicas and export Jobs share it).", enum=list(ACCESS_MODES)),
            "mountPath": _str("Where replicas and export Jobs mount the adapters (default /adapters)."),
            "retention": _str(
                "Retain (default): an adapter's files stay when its FineTune goes; Delete: they go with it.",
                enum=list(RETENTION),
            ),
        },
    )
    autoscaling = _obj(
        "A HorizontalPodAutoscaler over the replicas.",
        {
            "metric": _str("queue | cpu | off (default off: spec.replicas pods).", enum=list(AUTOSCALE)),
            "minReplicas": _int("Lower bound (default spec.replicas).", minimum=1),
            "maxReplicas": _int("Upper bound (default max(4, minReplicas)).", minimum=1),
        },
    )
    weights = {
        "type": "object",
        "description": "Alias -> version -> percent of its traffic, e.g. cardio: {v1: 90, v2: 10}.",
        "additionalProperties": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
    }
    gateway = _obj(
        "Gateway routing: an InferencePool over the replicas and an InferenceObjective per adapter.",
        {
            "enabled": {"type": "boolean", "description": "Create them (default true)."},
            "endpointPicker": _str("The endpoint picker's Service (default <name>-pool-epp)."),
        },
    )
    return _obj(
        "One base model served to many adapters.",
        {
            "base": _obj(
                "The base model every adapter was trained on.",
                {"model": _str("A hub id, or a path under /data."), "revision": _str("The hub revision.")},
                ["model"],
            ),
            "profile": _str("cpu | gaudi | nvidia (default cpu).", enum=list(PROFILES)),
            "engine": _str("native (kubetune serve; the registry and runtime routes it reads).", enum=["native"]),
            "image": _str("The server's image (default kubetune's for the profile)."),
            "replicas": _int("Server pods (default 1).", minimum=1),
            "autoscaling": autoscaling,
            "maxLoras": _int("Adapters resident at once per replica (default 8).", minimum=1),
            "apiKeySecret": _str(
                "A Secret whose key api-key holds the replicas' API key(s), comma-separated; every request, the "
                "runtime adapter routes included, needs one. Default: <name>-api-key, which the operator creates."
            ),
            "adapterStorage": storage,
            "weights": weights,
            "gateway": gateway,
        },
        ["base"],
    )


def status_schema() -> Schema:
    adapter = _obj(
        "One registered adapter version.",
        {
            "name": _str("The adapter (the alias)."),
            "version": _str("vN."),
            "servedName": _str("NAME@vN, the model name requests use."),
            "path": _str("Its directory on the adapter volume."),
            "finetune": _str("The FineTune that exported it."),
        },
        ["name", "version"],
    )
    failure = _obj(
        "A load that failed on this replica (retried with backoff).",
        {"adapter": _str("NAME@vN."), "reason": _str("The replica's answer."), "attempts": _int("Tries so far.")},
    )
    replica = _obj(
        "One ready replica's loaded adapters, as its /v1/models lists them.",
        {
            "pod": _str("The pod."),
            "ip": _str("Its IP."),
            "port": _int("Its `http` port."),
            "restarts": _int("Its containers' restarts."),
            "loaded": {"type": "array", "items": {"type": "string"}},
            "failed": {"type": "array", "items": failure},
            "unreachable": _str("Why the replica did not answer."),
        },
    )
    return _obj(
        "What the operator observed.",
        {
            "phase": _str(" | ".join(PHASES) + ".", enum=list(PHASES)),
            "readyReplicas": _int("Replicas that answer."),
            "adapterCount": _int("Registered adapter versions."),
            "adapters": {"type": "array", "description": "The registry, as the operator wrote it.", "items": adapter},
            "pods": {"type": "array", "description": "Each ready replica's loaded set.", "items": replica},
            "endpoint": _str("The OpenAI-compatible base URL of the Service."),
            "conditions": {
                "type": "array",
                "items": condition_schema(),
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
        },
    )


def printer_columns() -> list[Schema]:
    return [
        {"name": "Base", "type": "string", "jsonPath": ".spec.base.model"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Adapters", "type": "integer", "jsonPath": ".status.adapterCount"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd() -> Schema:
    schema = _obj(
        "A shared server of one base model and many LoRA adapters, owned by kubetune's operator.",
        {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        ["spec"],
    )
    version = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "subresources": {"status": {}},
        "additionalPrinterColumns": printer_columns(),
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "kubetune"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": "modelserver", "shortNames": ["ms"]},
            "versions": [version],
        },
    }


HEADER = "# Generated by `kubetune operator crd` (kubetune.operator.modelserver_crd); do not edit (a test compares).\n"


def crd_yaml() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=120)


def check_model_server(obj: dict[str, Any]) -> list[str]:
    """Problems the API server would report for this ModelServer under strict field validation."""
    return schema_problems(obj, crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
