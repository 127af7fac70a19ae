"""Kubernetes objects of a job, as plain dicts (`KubeObject`; pure, no API calls).

`worker_pod_template` is the training pod every job kind shares; the rest are the plain
objects around it: Namespace, ConfigMap, Secret, PVC, data-access Pod, PriorityClass,
ResourceQuota, PodGroup. Keys are in alphabetical order where the object has always been
rendered so (the snapshots compare the YAML text); `drop_none` leaves out unset fields.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import yaml

from kubetune.contracts.kube import KUBETUNE, NAME, KubeObject, common_labels, drop_none, parse_quantity
from kubetune.contracts.metrics import METRICS_PORT_NAME
from kubetune.contracts.serving import ROLLOUT_WAIT_ENV, ROLLOUT_WAIT_IN_CLUSTER_S
from kubetune.errors import RecipeError
from kubetune.k8s import claims, profiles
from kubetune.k8s.names import (
    COSCHEDULING_LABEL,
    DATA_DIR,
    DATA_POD_RESOURCES,
    DEFAULT_GANG_SCHEDULER,
    NAMESPACE_QUOTA,
    PYTORCHJOB_PORT,
    RECIPE_DIR,
    RECIPE_KEY,
    TOKEN_KEY,
    TRAIN_COMMAND,
    VOLCANO_ANNOTATION,
    Names,
    standard_labels,
)
from kubetune.recipe.gated import needs_token
from kubetune.recipe.k8s import K8sSection
from kubetune.recipe.schema import Recipe


def object_meta(
    names: Names, name: str, component: str, namespaced: bool = True, labels: dict[str, str] | None = None
) -> KubeObject:
    return drop_none(
        {
            "labels": {**standard_labels(names, component), **(labels or {})},
            "name": name,
            "namespace": names.namespace if namespaced else None,
        }
    )


# ---------------------------------------------------------------------------------- worker pod


def _env(name: str, value: str) -> KubeObject:
    return {"name": name, "value": value}


def worker_env(recipe: Recipe, names: Names) -> list[KubeObject]:
    k8s = recipe.k8s
    # optional for a public model (the pod starts without the Secret); a gated one's pods wait
    # for the Secret (CreateContainerConfigError names it) instead of failing with the Hub's 401.
    token = {"key": TOKEN_KEY, "name": names.secret, "optional": not needs_token(recipe)}
    env = [
        _env("KUBETUNE_CACHE", f"{DATA_DIR}/cache"),
        _env("HF_HOME", f"{DATA_DIR}/hf"),
        {"name": TOKEN_KEY, "valueFrom": {"secretKeyRef": token}},
        _env("KUBETUNE_MEMORY_BUDGET", str(profiles.memory_budget_bytes(k8s))),
        _env("PYTHONUNBUFFERED", "1"),
    ]
    rl = recipe.finetune.rl
    if recipe.finetune.objective == "grpo" and rl.rollout == "server":  # the server may still be loading
        env.append(_env(ROLLOUT_WAIT_ENV, str(ROLLOUT_WAIT_IN_CLUSTER_S)))
    return env + [_env(k, v) for k, v in profiles.comm_environment(recipe).items()]


def tracking_env_from(recipe: Recipe) -> list[KubeObject] | None:
    """monitor.tracking_env_from: the trackers' settings (MLFLOW_TRACKING_URI, WANDB_API_KEY, ...) as
    the pods' environment, every key of the Secret / ConfigMap a variable (None: no envFrom)."""
    source = recipe.monitor.tracking_env_from
    env_from = [{"configMapRef": {"name": source.config_map}}] if source.config_map else []
    env_from += [{"secretRef": {"name": source.secret}}] if source.secret else []
    return env_from or None


def data_volume(names: Names) -> KubeObject:
    """The job's volume claim (the workers', the data pod's and the export Job's /data)."""
    return {"name": "data", "persistentVolumeClaim": {"claimName": names.pvc}}


def data_mount() -> KubeObject:
    return {"mountPath": DATA_DIR, "name": "data"}


def worker_volumes(k8s: K8sSection, names: Names) -> list[KubeObject]:
    shm = k8s.worker_resources()["shm_size"]
    recipe_items = [{"key": RECIPE_KEY, "path": RECIPE_KEY}]
    return [
        {"configMap": {"items": recipe_items, "name": names.recipe}, "name": "recipe"},
        data_volume(names),
        # The container runtime's default /dev/shm is 64Mi: too small for data-loader workers
        # and shared-memory collectives. Memory-backed, so it counts against the memory limit.
        {"emptyDir": {"medium": "Memory", "sizeLimit": str(shm)}, "name": "dshm"},
    ]


def worker_mounts() -> list[KubeObject]:
    return [
        {"mountPath": RECIPE_DIR, "name": "recipe", "readOnly": True},
        data_mount(),
        {"mountPath": "/dev/shm", "name": "dshm"},
    ]


def _worker_ports(recipe: Recipe, container_name: str) -> list[KubeObject] | None:
    if container_name != "pytorch":  # a TrainJob's runtime patch takes no ports (its PodMonitor copes)
        return None
    ports = [{"containerPort": PYTORCHJOB_PORT, "name": "pytorchjob-port"}]
    if recipe.monitor.in_cluster and recipe.monitor.port:
        ports.append({"containerPort": recipe.monitor.port, "name": METRICS_PORT_NAME})
    return ports


def worker_container(recipe: Recipe, names: Names, container_name: str) -> KubeObject:
    k8s = recipe.k8s
    # RDMA devices and IPC_LOCK: the scale-out settings, as in the pod (`worker_pod_template`)
    return drop_none(
        {
            "command": list(TRAIN_COMMAND),
            "env": worker_env(recipe, names),
            "envFrom": tracking_env_from(recipe),
            "image": k8s.container_image(),
            "imagePullPolicy": k8s.image_pull_policy,
            "name": container_name,
            "ports": _worker_ports(recipe, container_name),
            "resources": profiles.worker_resources(k8s, profiles.rdma_devices(recipe)),
            "securityContext": profiles.container_security(k8s, profiles.scale_out_capabilities(recipe)),
            "volumeMounts": worker_mounts(),
        }
    )


def _gang_labels(k8s: K8sSection, names: Names) -> tuple[dict[str, str], dict[str, str]]:
    """Pod labels and annotations that tie workers to their PodGroup."""
    if k8s.gang == "coscheduling":
        return {COSCHEDULING_LABEL: names.job}, {}
    if k8s.gang == "volcano":
        return {}, {VOLCANO_ANNOTATION: names.job}
    return {}, {}


def _scheduler(k8s: K8sSection) -> str | None:
    return k8s.scheduler_name or DEFAULT_GANG_SCHEDULER.get(k8s.gang)


def worker_pod_template(recipe: Recipe, names: Names, container_name: str) -> KubeObject:
    """A new pod template on every call: no two objects share its dicts."""
    k8s = recipe.k8s
    gang_labels, gang_annotations = _gang_labels(k8s, names)
    # dnsPolicy, hostNetwork, the nodeSelector's scale-out label and the Multus annotation: the
    # scale-out settings (profiles, "scale-out networking")
    spec = {
        "affinity": profiles.node_affinity(k8s),
        "containers": [worker_container(recipe, names, container_name)],
        "dnsPolicy": profiles.dns_policy(recipe),
        "hostIPC": True if profiles.PROFILES[k8s.profile].host_ipc else None,
        "hostNetwork": True if k8s.network.host_network else None,
        "nodeSelector": profiles.worker_node_selector(recipe),
        "priorityClassName": k8s.priority_class,
        "resourceClaims": claims.pod_claims(k8s, names),  # k8s.devices=dra: the cards, claimed
        "schedulerName": _scheduler(k8s),
        "securityContext": profiles.pod_security(k8s),
        "serviceAccountName": k8s.service_account,
        "tolerations": profiles.tolerations(k8s),
        "volumes": worker_volumes(k8s, names),
    }
    meta = {
        "annotations": {**gang_annotations, **profiles.network_annotations(recipe)} or None,
        "labels": {**standard_labels(names, "trainer"), **gang_labels},
    }
    return {"metadata": drop_none(meta), "spec": drop_none(spec)}


# ------------------------------------------------------------------------------- plain objects


def namespace(names: Names) -> KubeObject:
    # Namespace labels only: the namespace may outlive (and predate) this job.
    meta = {"labels": {NAME: KUBETUNE}, "name": names.namespace}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def config_map(recipe: Recipe, names: Names) -> KubeObject:
    from kubetune.recipe.loader import recipe_to_yaml

    return {
        "apiVersion": "v1",
        "data": {RECIPE_KEY: recipe_to_yaml(recipe)},
        "kind": "ConfigMap",
        "metadata": object_meta(names, names.recipe, "recipe"),
    }


def recipe_text_data(text: str, where: str) -> dict[str, Any]:
    """A recipe YAML (a ConfigMap's) as data; one line for what is wrong with it."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe is a YAML mapping of sections (model:, data:, train:, ...)")
    return data


def config_map_recipe(recipe_config_map: KubeObject) -> Recipe:
    """The recipe a job's pods run, from its ConfigMap (`config_map`: already resolved by the renderer)."""
    from kubetune.recipe.loader import recipe_from_data

    where = f"ConfigMap {recipe_config_map['metadata']['name']}"
    return recipe_from_data(recipe_text_data(recipe_config_map["data"][RECIPE_KEY], where)).recipe


def secret(names: Names, token: str) -> KubeObject:
    import base64

    # `data`, not `stringData`: the same bytes whether applied by kubectl or by submit.
    return {
        "apiVersion": "v1",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
        "kind": "Secret",
        "metadata": object_meta(names, names.secret, "credentials"),
        "type": "Opaque",
    }


def pvc(k8s: K8sSection, names: Names) -> KubeObject:
    spec = {
        "accessModes": [k8s.storage.access_mode],
        "resources": {"requests": {"storage": str(k8s.storage.size)}},
        "storageClassName": k8s.storage.storage_class,
    }
    metadata = object_meta(names, names.pvc, "data")
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata, "spec": drop_none(spec)}


def data_pod(k8s: K8sSection, names: Names) -> KubeObject:
    """A small long-running pod on the PVC: `kubectl cp` / `kubetune k8s download` go through it."""
    container = {
        "command": ["sleep", "infinity"],
        "image": k8s.container_image(),
        "imagePullPolicy": k8s.image_pull_policy,
        "name": "data",
        "resources": {"limits": dict(DATA_POD_RESOURCES), "requests": dict(DATA_POD_RESOURCES)},
        # Gaudi images run as root; the data pod needs none of the trainer's extra capabilities.
        "securityContext": profiles.container_security(k8s) if profiles.PROFILES[k8s.profile].non_root else None,
        "volumeMounts": [data_mount()],
    }
    # Same user as the trainers, so it can read (and clean) what they wrote.
    spec = {
        "containers": [drop_none(container)],
        "restartPolicy": "Always",
        "securityContext": profiles.pod_security(k8s),
        "serviceAccountName": k8s.service_account,
        "volumes": [data_volume(names)],
    }
    metadata = object_meta(names, names.data_pod, "data")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": drop_none(spec)}


def priority_class(k8s: K8sSection, names: Names) -> KubeObject:
    if k8s.priority_class is None:  # resource_problems refuses this before render gets here
        raise RecipeError("k8s.priority_value needs k8s.priority_class (the PriorityClass name)")
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "description": f"kubetune job {names.namespace}/{names.job}",
        "kind": "PriorityClass",
        "metadata": object_meta(names, k8s.priority_class, "priority", namespaced=False),
        "preemptionPolicy": "PreemptLowerPriority",
        "value": k8s.priority_value,  # render adds the PriorityClass only when it is set
    }


def _format_quantity(value: Decimal, binary: bool) -> str:
    if not binary:
        millis = int(value * 1000)
        return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"
    as_int = int(value)
    for suffix, size in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if as_int % size == 0:
            return f"{as_int // size}{suffix}"
    return str(as_int)


def resource_quota(k8s: K8sSection, names: Names) -> KubeObject:
    """Exactly this job: the most workers it may run plus the data-access pod."""
    workers = k8s.elastic_range()[1] if k8s.elastic.enabled else k8s.replicas
    per_worker = profiles.resource_list(k8s)
    hard: dict[str, str] = {}
    for resource, quantity in per_worker.items():
        total = parse_quantity(quantity) * workers + parse_quantity(DATA_POD_RESOURCES.get(resource, "0"))
        text = _format_quantity(total, binary=resource not in ("cpu",) and "/" not in resource)
        if "/" in resource:  # extended resources are only quota'd by requests
            hard[f"requests.{resource}"] = str(int(total))
        else:
            hard[f"requests.{resource}"] = text
            if not resource.startswith("hugepages"):
                hard[f"limits.{resource}"] = text
    hard["pods"] = str(workers + 1)
    if names.owns_pvc:
        hard["persistentvolumeclaims"] = "1"
        hard["requests.storage"] = str(k8s.storage.size)
    return _quota(object_meta(names, names.quota, "quota"), hard)


def _quota(metadata: KubeObject, hard: dict[str, str]) -> KubeObject:
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": metadata, "spec": {"hard": hard}}


def namespace_quota(k8s: K8sSection, names: Names) -> KubeObject:
    """The team's budget for the namespace (k8s.namespace_quota): shared by every job there,
    so its labels name no job (`delete --purge` of one job leaves it)."""
    budget, hard = k8s.namespace_quota, {}
    for resource, value in (("cpu", budget.cpu), ("memory", budget.memory)):
        if value is not None:  # pods are Guaranteed (requests = limits): cap both the same
            hard[f"requests.{resource}"] = hard[f"limits.{resource}"] = str(value)
    accelerator = profiles.PROFILES[k8s.profile].accelerator_resource
    if budget.accelerators is not None and accelerator:
        hard[f"requests.{accelerator}"] = str(budget.accelerators)
    if budget.pods is not None:
        hard["pods"] = str(budget.pods)
    labels = common_labels(KUBETUNE, "namespace-quota", managed_by=KUBETUNE)
    return _quota({"labels": labels, "name": NAMESPACE_QUOTA, "namespace": names.namespace}, hard)


def pod_group(k8s: K8sSection, names: Names) -> KubeObject:
    """Gang scheduling for PyTorchJob: no worker starts until all of them fit."""
    members = k8s.elastic_range()[0] if k8s.elastic.enabled else k8s.replicas
    meta = {"name": names.job, "namespace": names.namespace, "labels": standard_labels(names, "podgroup")}
    if k8s.gang == "coscheduling":
        return {
            "apiVersion": "scheduling.x-k8s.io/v1alpha1",
            "kind": "PodGroup",
            "metadata": meta,
            "spec": {"minMember": members, "scheduleTimeoutSeconds": 600},
        }
    spec: KubeObject = {"minMember": members}
    if k8s.queue:
        spec["queue"] = k8s.queue
    if k8s.priority_class:
        spec["priorityClassName"] = k8s.priority_class
    return {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup", "metadata": meta, "spec": spec}
