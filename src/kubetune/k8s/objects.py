"""Kubernetes objects of a job, built with the kubernetes client models (pure, no API calls).

`worker_pod_template` is the training pod every job kind shares; the rest are the plain
objects around it: Namespace, ConfigMap, Secret, PVC, data-access Pod, PriorityClass,
ResourceQuota, PodGroup. Models are turned into dicts with `sanitize_for_serialization`.
"""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING, Any

import yaml

from kubetune.contracts.kube import KUBETUNE, NAME, KubeObject, common_labels, parse_quantity
from kubetune.contracts.metrics import METRICS_PORT_NAME
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

if TYPE_CHECKING:  # the kubernetes client is untyped: these names document intent (they are Any to mypy)
    from kubernetes.client import V1Container, V1EnvVar, V1ObjectMeta, V1PodTemplateSpec, V1Volume, V1VolumeMount


def object_meta(
    names: Names, name: str, component: str, namespaced: bool = True, labels: dict[str, str] | None = None
) -> V1ObjectMeta:
    from kubernetes.client import V1ObjectMeta

    return V1ObjectMeta(
        name=name,
        namespace=names.namespace if namespaced else None,
        labels={**standard_labels(names, component), **(labels or {})},
    )


def to_dict(model: object) -> KubeObject:
    from kubernetes.client import ApiClient

    data: KubeObject = ApiClient().sanitize_for_serialization(model)
    return data


# ---------------------------------------------------------------------------------- worker pod


def worker_env(recipe: Recipe, names: Names) -> list[V1EnvVar]:
    from kubernetes.client import V1EnvVar, V1EnvVarSource, V1SecretKeySelector

    k8s = recipe.k8s
    env = [
        V1EnvVar(name="KUBETUNE_CACHE", value=f"{DATA_DIR}/cache"),
        V1EnvVar(name="HF_HOME", value=f"{DATA_DIR}/hf"),
        # optional for a public model (the pod starts without the Secret); a gated one's pods wait
        # for the Secret (CreateContainerConfigError names it) instead of failing with the Hub's 401.
        V1EnvVar(
            name=TOKEN_KEY,
            value_from=V1EnvVarSource(
                secret_key_ref=V1SecretKeySelector(name=names.secret, key=TOKEN_KEY, optional=not needs_token(recipe))
            ),
        ),
        V1EnvVar(name="KUBETUNE_MEMORY_BUDGET", value=str(profiles.memory_budget_bytes(k8s))),
        V1EnvVar(name="PYTHONUNBUFFERED", value="1"),
    ]
    env += [V1EnvVar(name=k, value=v) for k, v in profiles.comm_environment(recipe).items()]
    return env


def worker_volumes(k8s: K8sSection, names: Names) -> list[V1Volume]:
    from kubernetes.client import (
        V1ConfigMapVolumeSource,
        V1EmptyDirVolumeSource,
        V1KeyToPath,
        V1PersistentVolumeClaimVolumeSource,
        V1Volume,
    )

    shm = k8s.worker_resources()["shm_size"]
    return [
        V1Volume(
            name="recipe",
            config_map=V1ConfigMapVolumeSource(name=names.recipe, items=[V1KeyToPath(key=RECIPE_KEY, path=RECIPE_KEY)]),
        ),
        V1Volume(name="data", persistent_volume_claim=V1PersistentVolumeClaimVolumeSource(claim_name=names.pvc)),
        # The container runtime's default /dev/shm is 64Mi: too small for data-loader workers
        # and shared-memory collectives. Memory-backed, so it counts against the memory limit.
        V1Volume(name="dshm", empty_dir=V1EmptyDirVolumeSource(medium="Memory", size_limit=str(shm))),
    ]


def worker_mounts() -> list[V1VolumeMount]:
    from kubernetes.client import V1VolumeMount

    return [
        V1VolumeMount(name="recipe", mount_path=RECIPE_DIR, read_only=True),
        V1VolumeMount(name="data", mount_path=DATA_DIR),
        V1VolumeMount(name="dshm", mount_path="/dev/shm"),
    ]


def worker_container(recipe: Recipe, names: Names, container_name: str) -> V1Container:
    from kubernetes.client import V1Container, V1ContainerPort

    k8s = recipe.k8s
    ports = None
    if container_name == "pytorch":  # a TrainJob's runtime patch takes no ports (its PodMonitor copes)
        ports = [V1ContainerPort(name="pytorchjob-port", container_port=PYTORCHJOB_PORT)]
        if recipe.monitor.in_cluster and recipe.monitor.port:
            ports.append(V1ContainerPort(name=METRICS_PORT_NAME, container_port=recipe.monitor.port))
    return V1Container(
        name=container_name,
        image=k8s.container_image(),
        image_pull_policy=k8s.image_pull_policy,
        command=list(TRAIN_COMMAND),
        env=worker_env(recipe, names),
        ports=ports,
        resources=profiles.worker_resources(k8s),
        volume_mounts=worker_mounts(),
        security_context=profiles.container_security(k8s),
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


def worker_pod_template(recipe: Recipe, names: Names, container_name: str) -> V1PodTemplateSpec:
    from kubernetes.client import V1ObjectMeta, V1PodSpec, V1PodTemplateSpec

    k8s = recipe.k8s
    gang_labels, gang_annotations = _gang_labels(k8s, names)
    spec = V1PodSpec(
        containers=[worker_container(recipe, names, container_name)],
        volumes=worker_volumes(k8s, names),
        node_selector=dict(k8s.node_selector) or None,
        tolerations=profiles.tolerations(k8s),
        affinity=profiles.node_affinity(k8s),
        security_context=profiles.pod_security(k8s),
        host_ipc=True if profiles.PROFILES[k8s.profile].host_ipc else None,
        priority_class_name=k8s.priority_class,
        scheduler_name=_scheduler(k8s),
        service_account_name=k8s.service_account,
        resource_claims=claims.pod_claims(k8s, names),  # k8s.devices=dra: the cards, claimed
    )
    meta = V1ObjectMeta(
        labels={**standard_labels(names, "trainer"), **gang_labels}, annotations=gang_annotations or None
    )
    profiles.apply_scale_out(recipe, spec, meta)  # host network, RDMA, Multus, IPC_LOCK, scale-out nodes
    return V1PodTemplateSpec(metadata=meta, spec=spec)


# ------------------------------------------------------------------------------- plain objects


def namespace(names: Names) -> KubeObject:
    from kubernetes.client import V1Namespace, V1ObjectMeta

    # Namespace labels only: the namespace may outlive (and predate) this job.
    meta = V1ObjectMeta(name=names.namespace, labels={NAME: KUBETUNE})
    return to_dict(V1Namespace(api_version="v1", kind="Namespace", metadata=meta))


def config_map(recipe: Recipe, names: Names) -> KubeObject:
    from kubernetes.client import V1ConfigMap

    from kubetune.recipe.loader import recipe_to_yaml

    return to_dict(
        V1ConfigMap(
            api_version="v1",
            kind="ConfigMap",
            metadata=object_meta(names, names.recipe, "recipe"),
            data={RECIPE_KEY: recipe_to_yaml(recipe)},
        )
    )


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

    from kubernetes.client import V1Secret

    # `data`, not `stringData`: the same bytes whether applied by kubectl or by submit.
    data = {TOKEN_KEY: base64.b64encode(token.encode()).decode()}
    return to_dict(
        V1Secret(
            api_version="v1",
            kind="Secret",
            type="Opaque",
            metadata=object_meta(names, names.secret, "credentials"),
            data=data,
        )
    )


def pvc(k8s: K8sSection, names: Names) -> KubeObject:
    from kubernetes.client import V1PersistentVolumeClaim, V1PersistentVolumeClaimSpec, V1VolumeResourceRequirements

    spec = V1PersistentVolumeClaimSpec(
        access_modes=[k8s.storage.access_mode],
        storage_class_name=k8s.storage.storage_class,
        resources=V1VolumeResourceRequirements(requests={"storage": str(k8s.storage.size)}),
    )
    return to_dict(
        V1PersistentVolumeClaim(
            api_version="v1", kind="PersistentVolumeClaim", metadata=object_meta(names, names.pvc, "data"), spec=spec
        )
    )


def data_pod(k8s: K8sSection, names: Names) -> KubeObject:
    """A small long-running pod on the PVC: `kubectl cp` / `kubetune k8s download` go through it."""
    from kubernetes.client import V1Container, V1Pod, V1PodSpec, V1ResourceRequirements, V1VolumeMount

    volumes = [v for v in worker_volumes(k8s, names) if v.name == "data"]
    container = V1Container(
        name="data",
        image=k8s.container_image(),
        image_pull_policy=k8s.image_pull_policy,
        command=["sleep", "infinity"],
        resources=V1ResourceRequirements(requests=dict(DATA_POD_RESOURCES), limits=dict(DATA_POD_RESOURCES)),
        volume_mounts=[V1VolumeMount(name="data", mount_path=DATA_DIR)],
        # Gaudi images run as root; the data pod needs none of the trainer's extra capabilities.
        security_context=profiles.container_security(k8s) if profiles.PROFILES[k8s.profile].non_root else None,
    )
    # Same user as the trainers, so it can read (and clean) what they wrote.
    spec = V1PodSpec(
        containers=[container],
        volumes=volumes,
        restart_policy="Always",
        security_context=profiles.pod_security(k8s),
        service_account_name=k8s.service_account,
    )
    return to_dict(V1Pod(api_version="v1", kind="Pod", metadata=object_meta(names, names.data_pod, "data"), spec=spec))


def priority_class(k8s: K8sSection, names: Names) -> KubeObject:
    from kubernetes.client import V1PriorityClass

    if k8s.priority_class is None:  # resource_problems refuses this before render gets here
        raise RecipeError("k8s.priority_value needs k8s.priority_class (the PriorityClass name)")
    return to_dict(
        V1PriorityClass(
            api_version="scheduling.k8s.io/v1",
            kind="PriorityClass",
            value=k8s.priority_value,
            metadata=object_meta(names, k8s.priority_class, "priority", namespaced=False),
            description=f"kubetune job {names.namespace}/{names.job}",
            preemption_policy="PreemptLowerPriority",
        )
    )


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
    from kubernetes.client import V1ResourceQuota, V1ResourceQuotaSpec

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
    return to_dict(
        V1ResourceQuota(
            api_version="v1",
            kind="ResourceQuota",
            metadata=object_meta(names, names.quota, "quota"),
            spec=V1ResourceQuotaSpec(hard=hard),
        )
    )


def namespace_quota(k8s: K8sSection, names: Names) -> KubeObject:
    """The team's budget for the namespace (k8s.namespace_quota): shared by every job there,
    so its labels name no job (`delete --purge` of one job leaves it)."""
    from kubernetes.client import V1ObjectMeta, V1ResourceQuota, V1ResourceQuotaSpec

    budget, hard = k8s.namespace_quota, {}
    for resource, value in (("cpu", budget.cpu), ("memory", budget.memory)):
        if value is not None:  # pods are Guaranteed (requests = limits): cap both the same
            hard[f"requests.{resource}"] = hard[f"limits.{resource}"] = str(value)
    accelerator = profiles.PROFILES[k8s.profile].accelerator_resource
    if budget.accelerators is not None and accelerator:
        hard[f"requests.{accelerator}"] = str(budget.accelerators)
    if budget.pods is not None:
        hard["pods"] = str(budget.pods)
    meta = V1ObjectMeta(
        name=NAMESPACE_QUOTA,
        namespace=names.namespace,
        labels=common_labels(KUBETUNE, "namespace-quota", managed_by=KUBETUNE),
    )
    return to_dict(
        V1ResourceQuota(api_version="v1", kind="ResourceQuota", metadata=meta, spec=V1ResourceQuotaSpec(hard=hard))
    )


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
