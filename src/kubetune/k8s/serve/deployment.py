"""The server's Deployment (its container, probes, volumes, placement) and its
PodDisruptionBudget."""

from __future__ import annotations

import math

from kubetune.contracts.kube import KubeObject, drop_none
from kubetune.contracts.serving import (
    DEFAULT_PORT,
    DRAIN_TIMEOUT_S,
    HEALTH_PATH,
    METRICS_PATH,
    READY_PATH,
    VLLM_READY_PATH,
)
from kubetune.k8s import claims, profiles
from kubetune.k8s.serve.argv import CACHE_DIR, server_argv, server_env
from kubetune.k8s.serve.plan import MODEL_IMAGE_DIR, MODELS_DIR, PORT_NAME, Plan, startup_seconds
from kubetune.recipe.k8s import VLLM_IMAGES

CONTAINER = "server"
ADAPTERS_SUBPATH = "adapters"  # a ModelServer's adapters on its claim (its /data keeps the model cache)
PROBE_PERIOD_S = 10
# preStop: the pod leaves the Service's endpoints while this sleeps, so the ingress controller
# stops sending it requests before SIGTERM makes the server refuse them.
PRESTOP_SLEEP_S = 10
EXIT_MARGIN_S = 10
CPU_FEATURE_WEIGHT = 100  # the preferred node affinity's weight (1..100): the strongest preference


def _probe(path: str, period: int, timeout: int, failures: int) -> KubeObject:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _ready_path(plan: Plan) -> str:
    if plan.engine == "native":
        return READY_PATH
    # vLLM asks for the key on /v1/models, and a probe could only send it written into the manifest;
    # its /health stays open and, as vLLM listens only once the model is loaded, means ready too.
    return HEALTH_PATH if plan.settings.api_key_secret else VLLM_READY_PATH


def server_container(plan: Plan, startup_s: int) -> KubeObject:
    ready = _ready_path(plan)
    run: KubeObject = {"name": "models" if plan.settings.model_image else "data", "mountPath": plan.root}
    if plan.rollout:
        run["readOnly"] = True
    mounts: list[KubeObject] = [run, {"name": "dshm", "mountPath": "/dev/shm"}]
    if plan.engine == "vllm" or plan.rollout:
        mounts.append({"name": "cache", "mountPath": CACHE_DIR})
    if plan.adapter_serving is not None:  # the ModelServer's claim holds the adapters under adapters/
        mounts.append({"name": "data", "mountPath": plan.adapter_serving.root, "subPath": ADAPTERS_SUBPATH})
    container: KubeObject = {
        "name": CONTAINER,
        "image": plan.settings.image
        or (plan.k8s.container_image() if plan.engine == "native" else VLLM_IMAGES[plan.k8s.profile]),
        "imagePullPolicy": plan.k8s.image_pull_policy,
        "command": server_argv(plan),
        "env": server_env(plan),
        "ports": [{"name": PORT_NAME, "containerPort": DEFAULT_PORT, "protocol": "TCP"}],
        "resources": profiles.worker_resources(plan.k8s),
        "volumeMounts": mounts,
        # Liveness only starts once the model is loaded (startup passed): a busy CPU pod that
        # answers /health slowly gets a minute before it is restarted.
        "startupProbe": _probe(ready, PROBE_PERIOD_S, 5, math.ceil(startup_s / PROBE_PERIOD_S)),
        "readinessProbe": _probe(ready, 5, 5, 3),
        "livenessProbe": _probe(HEALTH_PATH, 10, 10, 6),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}},
        "securityContext": profiles.container_security(plan.k8s),
    }
    return container


def _model_copier(plan: Plan, container: KubeObject) -> KubeObject:
    """--model-image: copy the run directory out of the image before the server starts."""
    limits = {k: v for k, v in container["resources"]["limits"].items() if k in ("cpu", "memory")}
    return {
        "name": "model",
        "image": plan.settings.model_image,
        "imagePullPolicy": plan.k8s.image_pull_policy,
        "command": ["cp", "-R", f"{MODEL_IMAGE_DIR}/.", plan.run_dir],
        # as much as the server asks for (and no more), so the pod stays Guaranteed
        "resources": {"requests": dict(limits), "limits": limits},
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR}],
        "securityContext": container["securityContext"],
    }


def _volumes(plan: Plan) -> list[KubeObject]:
    shm = plan.k8s.worker_resources()["shm_size"]
    dshm: KubeObject = {"medium": "Memory"}
    if shm:
        dshm["sizeLimit"] = str(shm)
    volumes: list[KubeObject] = [
        {"name": "models", "emptyDir": {}}
        if plan.settings.model_image
        else {"name": "data", "persistentVolumeClaim": {"claimName": plan.job.pvc}},
        {"name": "dshm", "emptyDir": dshm},
    ]
    if plan.engine == "vllm" or plan.rollout:
        volumes.append({"name": "cache", "emptyDir": {}})
    return volumes


def _affinity(plan: Plan) -> KubeObject | None:
    """The profile's CPU-feature requirement (cpu: AMX nodes, for bf16 matmuls) as a preference
    unless --require-cpu-features: on a cluster without such nodes (or without their NFD label) the
    server is scheduled anyway and runs in fp32, where a requirement would leave it Pending."""
    affinity = profiles.node_affinity(plan.k8s)
    if not affinity or plan.settings.require_cpu_features:
        return affinity
    node = affinity["nodeAffinity"]
    terms = node.pop("requiredDuringSchedulingIgnoredDuringExecution")["nodeSelectorTerms"]
    node["preferredDuringSchedulingIgnoredDuringExecution"] = [
        {"weight": CPU_FEATURE_WEIGHT, "preference": term} for term in terms
    ]
    return affinity


def deployment(plan: Plan) -> KubeObject:
    k8s, settings = plan.k8s, plan.settings
    startup_s = startup_seconds(plan.params, plan.engine, k8s.profile)
    container = server_container(plan, startup_s)
    pod_spec: KubeObject = drop_none(
        {
            "initContainers": [_model_copier(plan, container)] if settings.model_image else None,
            "containers": [container],
            "volumes": _volumes(plan),
            "terminationGracePeriodSeconds": PRESTOP_SLEEP_S + DRAIN_TIMEOUT_S + EXIT_MARGIN_S,
            "automountServiceAccountToken": False,  # the server never talks to the API server
            "nodeSelector": dict(k8s.node_selector) or None,
            "tolerations": profiles.tolerations(k8s),
            "affinity": _affinity(plan),
            "securityContext": profiles.pod_security(k8s),
            "hostIPC": True if profiles.PROFILES[k8s.profile].host_ipc else None,
            "priorityClassName": k8s.priority_class,
            "serviceAccountName": k8s.service_account,
            "resourceClaims": claims.pod_claims(k8s, plan.names),  # k8s.devices=dra: the cards, claimed
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": plan.selector},
                }
            ],
        }
    )
    template = {
        "metadata": {
            "labels": plan.labels,
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(DEFAULT_PORT),
                "prometheus.io/path": METRICS_PATH,
            },
        },
        "spec": pod_spec,
    }
    spec: KubeObject = {
        "selector": {"matchLabels": plan.selector},
        # a new pod loads its model before an old one leaves
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        # loading is progress: the rollout is not "failed" while the startup probe still waits
        "progressDeadlineSeconds": startup_s + 300,
        "revisionHistoryLimit": 3,
        "template": template,
    }
    if settings.autoscale == "off":
        spec = {"replicas": settings.replicas, **spec}
    # else no replicas: the HPA owns the count, and re-applying this object must not reset it
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": plan.meta(plan.names.job), "spec": spec}


def disruption_budget(plan: Plan) -> KubeObject:
    """One pod at a time, whatever the count: maxUnavailable follows the HPA, where a fixed
    minAvailable would block node drains at the minimum; pods that never got ready (a model
    that does not load) may always be evicted."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": plan.meta(plan.names.job),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": plan.selector},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
