"""Render (pure): recipe -> Kubernetes manifests, as plain dicts in apply order.

Objects: Namespace, [PriorityClass], [ResourceQuota], PVC, [Secret], ConfigMap (the
resolved recipe), [PodGroup], [ClusterTrainingRuntime], the data-access Pod, and the job
(PyTorchJob kubeflow.org/v1 or TrainJob trainer.kubeflow.org/v1alpha1). Every namespaced
object lives in `k8s.namespace`. Each training container runs

    kubetune train /etc/kubetune/recipe.yaml

with the PVC at /data (output_dir, the tokenized-data and model caches), so a restarted pod
resumes from its last checkpoint (train.resume=auto). Nothing here talks to a cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path, PurePosixPath

import yaml

from kubetune.errors import RecipeError
from kubetune.k8s import profiles
from kubetune.recipe.k8s import K8sSection, parse_quantity, resource_problems
from kubetune.recipe.schema import Recipe

RECIPE_DIR = "/etc/kubetune"
RECIPE_KEY = "recipe.yaml"
RECIPE_PATH = f"{RECIPE_DIR}/{RECIPE_KEY}"
DATA_DIR = "/data"
TRAIN_COMMAND = ["kubetune", "train", RECIPE_PATH]
TOKEN_KEY = "HF_TOKEN"
CONTAINER = {"pytorchjob": "pytorch", "trainjob": "node"}  # names the operators look for
PYTORCHJOB_PORT = 23456  # the training operator's default `pytorchjob-port`
PART_OF = "app.kubernetes.io/instance"
MANAGED_BY = "app.kubernetes.io/managed-by"
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"
COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"
VOLCANO_ANNOTATION = "scheduling.k8s.io/group-name"
DEFAULT_GANG_SCHEDULER = {"volcano": "volcano", "coscheduling": "scheduler-plugins-scheduler"}
DATA_POD_RESOURCES = {"cpu": "250m", "memory": "256Mi"}
TOKEN_REDACTED_NOTE = "# Secret {name}: not printed (it holds the Hugging Face token); use -o DIR or `kubetune k8s submit`"


@dataclass(frozen=True)
class Names:
    """Every object name derived from the job name, shared by render, submit and delete."""

    job: str
    namespace: str
    recipe: str
    secret: str
    pvc: str
    data_pod: str
    quota: str
    runtime: str
    owns_pvc: bool

    @classmethod
    def for_job(cls, job: str, namespace: str, existing_claim: str | None = None) -> "Names":
        return cls(job=job, namespace=namespace, recipe=f"{job}-recipe", secret=f"{job}-hf-token",
                   pvc=existing_claim or f"{job}-data", data_pod=f"{job}-data", quota=f"{job}-quota",
                   runtime=f"{job}-runtime", owns_pvc=existing_claim is None)


@dataclass
class Rendered:
    objects: list[dict]
    names: Names
    warnings: list[str] = field(default_factory=list)

    @property
    def job(self) -> dict:
        return self.objects[-1]


def job_name(recipe: Recipe) -> str:
    """k8s.name, or output_dir's last part made a DNS-1123 label (short: pods add suffixes)."""
    if recipe.k8s.name:
        return recipe.k8s.name
    base = PurePosixPath(recipe.output_dir.rstrip("/")).name or "kubetune"
    slug = re.sub(r"[^a-z0-9-]+", "-", base.lower()).strip("-")[:40].strip("-")
    return slug or "kubetune"


def cluster_recipe(recipe: Recipe, names: Names) -> Recipe:
    """The recipe as the pods see it: output_dir on the PVC (checkpoints survive restarts)."""
    out = recipe.output_dir
    if not (out == DATA_DIR or out.startswith(DATA_DIR + "/")):
        out = f"{DATA_DIR}/runs/{names.job}"
    return recipe.model_copy(update={"output_dir": out})


def _labels(names: Names, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kubetune", PART_OF: names.job,
            "app.kubernetes.io/component": component, MANAGED_BY: "kubetune"}


def _meta(names: Names, name: str, component: str, namespaced: bool = True, labels: dict | None = None):
    from kubernetes.client import V1ObjectMeta

    return V1ObjectMeta(name=name, namespace=names.namespace if namespaced else None,
                        labels={**_labels(names, component), **(labels or {})})


def _to_dict(model) -> dict:
    from kubernetes.client import ApiClient

    return ApiClient().sanitize_for_serialization(model)


# ---------------------------------------------------------------------------------- worker pod


def _env(recipe: Recipe, names: Names) -> list:
    from kubernetes.client import V1EnvVar, V1EnvVarSource, V1SecretKeySelector

    k8s = recipe.k8s
    env = [
        V1EnvVar(name="KUBETUNE_CACHE", value=f"{DATA_DIR}/cache"),
        V1EnvVar(name="HF_HOME", value=f"{DATA_DIR}/hf"),
        # optional: public models need no token, and the pod must still start without the Secret.
        V1EnvVar(name=TOKEN_KEY, value_from=V1EnvVarSource(
            secret_key_ref=V1SecretKeySelector(name=names.secret, key=TOKEN_KEY, optional=True))),
        V1EnvVar(name="KUBETUNE_MEMORY_BUDGET", value=str(profiles.memory_budget_bytes(k8s))),
        V1EnvVar(name="PYTHONUNBUFFERED", value="1"),
    ]
    env += [V1EnvVar(name=k, value=v) for k, v in profiles.comm_environment(recipe).items()]
    return env


def _volumes(k8s: K8sSection, names: Names) -> list:
    from kubernetes.client import (V1ConfigMapVolumeSource, V1EmptyDirVolumeSource, V1KeyToPath,
                                   V1PersistentVolumeClaimVolumeSource, V1Volume)

    shm = k8s.worker_resources()["shm_size"]
    return [
        V1Volume(name="recipe", config_map=V1ConfigMapVolumeSource(
            name=names.recipe, items=[V1KeyToPath(key=RECIPE_KEY, path=RECIPE_KEY)])),
        V1Volume(name="data", persistent_volume_claim=V1PersistentVolumeClaimVolumeSource(claim_name=names.pvc)),
        # The container runtime's default /dev/shm is 64Mi: too small for data-loader workers
        # and shared-memory collectives. Memory-backed, so it counts against the memory limit.
        V1Volume(name="dshm", empty_dir=V1EmptyDirVolumeSource(medium="Memory", size_limit=str(shm))),
    ]


def _mounts() -> list:
    from kubernetes.client import V1VolumeMount

    return [V1VolumeMount(name="recipe", mount_path=RECIPE_DIR, read_only=True),
            V1VolumeMount(name="data", mount_path=DATA_DIR),
            V1VolumeMount(name="dshm", mount_path="/dev/shm")]


def _container(recipe: Recipe, names: Names, container_name: str):
    from kubernetes.client import V1Container, V1ContainerPort

    k8s = recipe.k8s
    ports = [V1ContainerPort(name="pytorchjob-port", container_port=PYTORCHJOB_PORT)] if container_name == "pytorch" else None
    return V1Container(
        name=container_name, image=k8s.image, image_pull_policy=k8s.image_pull_policy,
        command=list(TRAIN_COMMAND), env=_env(recipe, names), ports=ports,
        resources=profiles.worker_resources(k8s), volume_mounts=_mounts(),
        security_context=profiles.container_security(k8s),
    )


def _gang_labels(k8s: K8sSection, names: Names) -> tuple[dict, dict]:
    """Pod labels and annotations that tie workers to their PodGroup."""
    if k8s.gang == "coscheduling":
        return {COSCHEDULING_LABEL: names.job}, {}
    if k8s.gang == "volcano":
        return {}, {VOLCANO_ANNOTATION: names.job}
    return {}, {}


def _scheduler(k8s: K8sSection) -> str | None:
    return k8s.scheduler_name or DEFAULT_GANG_SCHEDULER.get(k8s.gang)


def worker_pod_template(recipe: Recipe, names: Names, container_name: str):
    from kubernetes.client import V1ObjectMeta, V1PodSpec, V1PodTemplateSpec

    k8s = recipe.k8s
    gang_labels, gang_annotations = _gang_labels(k8s, names)
    spec = V1PodSpec(
        containers=[_container(recipe, names, container_name)],
        volumes=_volumes(k8s, names),
        node_selector=dict(k8s.node_selector) or None,
        tolerations=profiles.tolerations(k8s),
        affinity=profiles.node_affinity(k8s),
        security_context=profiles.pod_security(k8s),
        host_ipc=True if profiles.PROFILES[k8s.profile].host_ipc else None,
        priority_class_name=k8s.priority_class,
        scheduler_name=_scheduler(k8s),
        service_account_name=k8s.service_account,
    )
    meta = V1ObjectMeta(labels={**_labels(names, "trainer"), **gang_labels}, annotations=gang_annotations or None)
    return V1PodTemplateSpec(metadata=meta, spec=spec)


# ------------------------------------------------------------------------------- plain objects


def namespace(names: Names) -> dict:
    from kubernetes.client import V1Namespace, V1ObjectMeta

    # Namespace labels only: the namespace may outlive (and predate) this job.
    meta = V1ObjectMeta(name=names.namespace, labels={"app.kubernetes.io/name": "kubetune"})
    return _to_dict(V1Namespace(api_version="v1", kind="Namespace", metadata=meta))


def config_map(recipe: Recipe, names: Names) -> dict:
    from kubernetes.client import V1ConfigMap

    from kubetune.recipe.loader import recipe_to_yaml

    return _to_dict(V1ConfigMap(api_version="v1", kind="ConfigMap", metadata=_meta(names, names.recipe, "recipe"),
                                data={RECIPE_KEY: recipe_to_yaml(recipe)}))


def secret(names: Names, token: str) -> dict:
    import base64

    from kubernetes.client import V1Secret

    # `data`, not `stringData`: the same bytes whether applied by kubectl or by submit.
    data = {TOKEN_KEY: base64.b64encode(token.encode()).decode()}
    return _to_dict(V1Secret(api_version="v1", kind="Secret", type="Opaque",
                             metadata=_meta(names, names.secret, "credentials"), data=data))


def pvc(k8s: K8sSection, names: Names) -> dict:
    from kubernetes.client import V1PersistentVolumeClaim, V1PersistentVolumeClaimSpec, V1VolumeResourceRequirements

    spec = V1PersistentVolumeClaimSpec(access_modes=[k8s.storage.access_mode],
                                       storage_class_name=k8s.storage.storage_class,
                                       resources=V1VolumeResourceRequirements(requests={"storage": str(k8s.storage.size)}))
    return _to_dict(V1PersistentVolumeClaim(api_version="v1", kind="PersistentVolumeClaim",
                                            metadata=_meta(names, names.pvc, "data"), spec=spec))


def data_pod(k8s: K8sSection, names: Names) -> dict:
    """A small long-running pod on the PVC: `kubectl cp` / `kubetune k8s download` go through it."""
    from kubernetes.client import V1Container, V1Pod, V1PodSpec, V1ResourceRequirements, V1VolumeMount

    volumes = [v for v in _volumes(k8s, names) if v.name == "data"]
    container = V1Container(
        name="data", image=k8s.image, image_pull_policy=k8s.image_pull_policy, command=["sleep", "infinity"],
        resources=V1ResourceRequirements(requests=dict(DATA_POD_RESOURCES), limits=dict(DATA_POD_RESOURCES)),
        volume_mounts=[V1VolumeMount(name="data", mount_path=DATA_DIR)],
        security_context=profiles.container_security(k8s.model_copy(update={"profile": "cpu"}))
        if profiles.PROFILES[k8s.profile].non_root else None,
    )
    # Same user as the trainers, so it can read (and clean) what they wrote.
    spec = V1PodSpec(containers=[container], volumes=volumes, restart_policy="Always",
                     security_context=profiles.pod_security(k8s), service_account_name=k8s.service_account)
    return _to_dict(V1Pod(api_version="v1", kind="Pod", metadata=_meta(names, names.data_pod, "data"), spec=spec))


def priority_class(k8s: K8sSection, names: Names) -> dict:
    from kubernetes.client import V1PriorityClass

    return _to_dict(V1PriorityClass(
        api_version="scheduling.k8s.io/v1", kind="PriorityClass", value=k8s.priority_value,
        metadata=_meta(names, k8s.priority_class, "priority", namespaced=False),
        description=f"kubetune job {names.namespace}/{names.job}", preemption_policy="PreemptLowerPriority"))


def _format_quantity(value: Decimal, binary: bool) -> str:
    if not binary:
        millis = int(value * 1000)
        return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"
    as_int = int(value)
    for suffix, size in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if as_int % size == 0:
            return f"{as_int // size}{suffix}"
    return str(as_int)


def resource_quota(k8s: K8sSection, names: Names) -> dict:
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
    return _to_dict(V1ResourceQuota(api_version="v1", kind="ResourceQuota",
                                    metadata=_meta(names, names.quota, "quota"), spec=V1ResourceQuotaSpec(hard=hard)))


def pod_group(k8s: K8sSection, names: Names) -> dict:
    """Gang scheduling for PyTorchJob: no worker starts until all of them fit."""
    members = k8s.elastic_range()[0] if k8s.elastic.enabled else k8s.replicas
    meta = {"name": names.job, "namespace": names.namespace, "labels": _labels(names, "podgroup")}
    if k8s.gang == "coscheduling":
        return {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup", "metadata": meta,
                "spec": {"minMember": members, "scheduleTimeoutSeconds": 600}}
    spec: dict = {"minMember": members}
    if k8s.queue:
        spec["queue"] = k8s.queue
    if k8s.priority_class:
        spec["priorityClassName"] = k8s.priority_class
    return {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup", "metadata": meta, "spec": spec}


# ------------------------------------------------------------------------------------- jobs


def _job_labels(k8s: K8sSection, names: Names) -> dict:
    # With Volcano the queue is Volcano's (PodGroup/schedulingPolicy); otherwise it is Kueue's.
    return {KUEUE_LABEL: k8s.queue} if k8s.queue and k8s.gang != "volcano" else {}


def pytorchjob(recipe: Recipe, names: Names) -> dict:
    from kubeflow.training.models import (KubeflowOrgV1ElasticPolicy, KubeflowOrgV1PyTorchJob,
                                          KubeflowOrgV1PyTorchJobSpec, KubeflowOrgV1ReplicaSpec,
                                          KubeflowOrgV1RunPolicy, KubeflowOrgV1SchedulingPolicy)

    k8s = recipe.k8s
    template = worker_pod_template(recipe, names, CONTAINER["pytorchjob"])

    def replicas(n: int):
        # OnFailure: a crashed container restarts in place and resumes from the last checkpoint.
        return KubeflowOrgV1ReplicaSpec(replicas=n, restart_policy="OnFailure", template=template)

    elastic = None
    if k8s.elastic.enabled:
        lo, hi = k8s.elastic_range()
        specs = {"Worker": replicas(k8s.replicas)}
        elastic = KubeflowOrgV1ElasticPolicy(min_replicas=lo, max_replicas=hi, rdzv_backend="c10d",
                                             max_restarts=k8s.elastic.max_restarts)
    else:
        specs = {"Master": replicas(1)}
        if k8s.replicas > 1:
            specs["Worker"] = replicas(k8s.replicas - 1)
    scheduling = None
    if k8s.gang == "volcano":
        scheduling = KubeflowOrgV1SchedulingPolicy(min_available=k8s.elastic_range()[0] if elastic else k8s.replicas,
                                                   queue=k8s.queue, priority_class=k8s.priority_class)
    # cleanPodPolicy Running: finished and failed pods stay for `logs` and `doctor`, while
    # pods still running when the job ends give their nodes back.
    run_policy = KubeflowOrgV1RunPolicy(clean_pod_policy="Running", backoff_limit=k8s.backoff_limit,
                                        scheduling_policy=scheduling)
    job = KubeflowOrgV1PyTorchJob(
        api_version="kubeflow.org/v1", kind="PyTorchJob",
        metadata=_meta(names, names.job, "job", labels=_job_labels(k8s, names)),
        spec=KubeflowOrgV1PyTorchJobSpec(pytorch_replica_specs=specs, run_policy=run_policy, elastic_policy=elastic,
                                         nproc_per_node=str(k8s.processes_per_pod())),
    )
    return _to_dict(job)


def _runtime_patch(recipe: Recipe, names: Names) -> dict:
    """What the TrainJob adds to the runtime's `node` pods: volumes, mounts, placement, security."""
    pod = _to_dict(worker_pod_template(recipe, names, CONTAINER["trainjob"]))
    spec = pod["spec"]
    container = spec["containers"][0]
    # Only the fields a v2.3 runtime patch accepts; image, command, env and resources travel
    # in spec.trainer, hostIPC / priority / scheduler in the runtime (see `cluster_runtime`).
    patch_spec = {k: spec[k] for k in ("volumes", "nodeSelector", "tolerations", "affinity",
                                       "securityContext", "serviceAccountName") if k in spec}
    patch_spec["containers"] = [{k: container[k] for k in ("name", "volumeMounts", "securityContext") if k in container}]
    replicated = {"name": "node", "template": {"spec": {"template": {"metadata": pod["metadata"], "spec": patch_spec}}}}
    return {"manager": "kubetune", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [replicated]}}}}


def trainjob(recipe: Recipe, names: Names, runtime_name: str) -> dict:
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    k8s = recipe.k8s
    container = _to_dict(_container(recipe, names, CONTAINER["trainjob"]))
    trainer = {"image": k8s.image, "command": container["command"], "env": container["env"],
               "numNodes": k8s.replicas, "resourcesPerNode": container["resources"]}
    if k8s.nproc_per_node != "auto":
        trainer["numProcPerNode"] = int(k8s.nproc_per_node)
    meta = _to_dict(_meta(names, names.job, "job", labels=_job_labels(k8s, names)))
    job = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": meta,
           "spec": {"runtimeRef": {"name": runtime_name, "apiGroup": "trainer.kubeflow.org",
                                   "kind": "ClusterTrainingRuntime"},
                    "trainer": trainer, "runtimePatches": [_runtime_patch(recipe, names)]}}
    # Round-trip through the Trainer SDK model: it fails loudly if the SDK disagrees on shape.
    return TrainerV1alpha1TrainJob.from_dict(job).to_dict()


def cluster_runtime(recipe: Recipe, names: Names) -> dict:
    """A ClusterTrainingRuntime carrying what a TrainJob cannot patch (hostIPC, priority, gang)."""
    from kubeflow_trainer_api.models import TrainerV1alpha1ClusterTrainingRuntime

    k8s = recipe.k8s
    pod = _to_dict(worker_pod_template(recipe, names, CONTAINER["trainjob"]))["spec"]
    pod_spec = {"containers": [{"name": "node", "image": k8s.image, "command": list(TRAIN_COMMAND)}]}
    pod_spec.update({k: pod[k] for k in ("hostIPC", "priorityClassName", "schedulerName") if k in pod})
    spec: dict = {
        "mlPolicy": {"numNodes": k8s.replicas, "torch": {}},
        "template": {"spec": {"replicatedJobs": [{
            "name": "node",
            # The Trainer injects spec.trainer (image, command, env, resources) into this step.
            "template": {"metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                         "spec": {"template": {"spec": pod_spec}}},
        }]}},
    }
    if k8s.gang == "coscheduling":
        spec["podGroupPolicy"] = {"coscheduling": {"scheduleTimeoutSeconds": 600}}
    elif k8s.gang == "volcano":
        spec["podGroupPolicy"] = {"volcano": {}}
    meta = _to_dict(_meta(names, names.runtime, "runtime", namespaced=False,
                          labels={"trainer.kubeflow.org/framework": "torch"}))
    obj = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime", "metadata": meta, "spec": spec}
    return TrainerV1alpha1ClusterTrainingRuntime.from_dict(obj).to_dict()


# ---------------------------------------------------------------------------------- render


def _portability_warnings(recipe: Recipe, with_runtime: bool) -> list[str]:
    k8s, warnings = recipe.k8s, []
    for key, value in (("data.train", recipe.data.train), ("data.eval", recipe.data.eval),
                       ("model.name_or_path", recipe.model.name_or_path)):
        if isinstance(value, str) and not value.startswith(DATA_DIR + "/") and Path(value).exists():
            warnings.append(f"{key}={value} is a local path the pods cannot see: copy it to the PVC "
                            f"(kubetune k8s download's data pod, /data/...) and point {key} there")
    if recipe.train.resume != "auto":
        warnings.append(f"train.resume={recipe.train.resume}: a restarted pod will not resume from its last checkpoint")
    if with_runtime and k8s.api != "trainjob":
        warnings.append("--with-runtime only applies to --api trainjob; ignored for a PyTorchJob")
    if k8s.api == "trainjob" and not with_runtime:
        missing = [what for what, needed in (("hostIPC (gaudi)", k8s.profile == "gaudi"),
                                             ("k8s.priority_class", bool(k8s.priority_class)),
                                             (f"k8s.gang={k8s.gang}", k8s.gang != "none")) if needed]
        if missing:
            warnings.append(f"a TrainJob cannot set {', '.join(missing)} itself: add --with-runtime "
                            f"or use a ClusterTrainingRuntime `{k8s.runtime}` that has them")
    return warnings


def render(recipe: Recipe, hf_token: str | None = None, with_runtime: bool = False) -> Rendered:
    """All manifests for `recipe` (k8s.profile / k8s.api already applied), in apply order."""
    k8s = recipe.k8s
    problems = resource_problems(k8s)
    if problems:
        raise RecipeError("; ".join(problems))
    names = Names.for_job(job_name(recipe), k8s.namespace, k8s.storage.existing_claim)
    resolved = cluster_recipe(recipe, names)
    objects = [namespace(names)]
    if k8s.priority_value is not None:
        objects.append(priority_class(k8s, names))
    if k8s.quota:
        objects.append(resource_quota(k8s, names))
    if names.owns_pvc:
        objects.append(pvc(k8s, names))
    if hf_token:
        objects.append(secret(names, hf_token))
    objects.append(config_map(resolved, names))
    if k8s.gang != "none" and k8s.api == "pytorchjob":
        objects.append(pod_group(k8s, names))
    runtime_name = k8s.runtime
    if k8s.api == "trainjob" and with_runtime:
        objects.append(cluster_runtime(resolved, names))
        runtime_name = names.runtime
    objects.append(data_pod(k8s, names))
    objects.append(pytorchjob(resolved, names) if k8s.api == "pytorchjob" else trainjob(resolved, names, runtime_name))
    if hf_token:
        _refuse_token_leak(objects, hf_token)
    return Rendered(objects=objects, names=names, warnings=_portability_warnings(recipe, with_runtime))


def _refuse_token_leak(objects: list[dict], token: str) -> None:
    """The token may only live in the Secret (e.g. not in comm.extra_env or a recipe value)."""
    if len(token) < 8:  # too short to search for without false alarms (real tokens are ~37 chars)
        return
    for obj in objects:
        if obj["kind"] != "Secret" and token in yaml.safe_dump(obj):
            raise RecipeError(f"the Hugging Face token appears in {obj['kind']} {obj['metadata']['name']}; "
                              "pass it only with --hf-token-file or HF_TOKEN, never in the recipe")


# ---------------------------------------------------------------------------------- output


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the recipe in the ConfigMap) as readable `|` blocks; no `&anchors`."""

    def ignore_aliases(self, data):
        return True


def _str_representer(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def _dump(obj: dict) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def to_yaml(objects: list[dict], redact_secrets: bool = True) -> str:
    """Multi-document YAML. Secrets are replaced by a comment unless `redact_secrets=False`."""
    docs = []
    for obj in objects:
        if obj["kind"] == "Secret" and redact_secrets:
            docs.append(TOKEN_REDACTED_NOTE.format(name=obj["metadata"]["name"]) + "\n")
        else:
            docs.append(_dump(obj))
    return "---\n" + "---\n".join(docs)


def file_name(obj: dict) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def write_dir(objects: list[dict], out_dir: Path) -> list[Path]:
    """One file per object plus kustomization.yaml (`kubectl apply -k DIR`). Secrets are 0600."""
    import os

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for obj in objects:
        path = out_dir / file_name(obj)
        if obj["kind"] == "Secret":
            # Created with 0600 from the start: the token is never world-readable, even briefly.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(_dump(obj))
            os.chmod(path, 0o600)
        else:
            path.write_text(_dump(obj), encoding="utf-8")
        written.append(path)
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": [p.name for p in written]}
    (out_dir / "kustomization.yaml").write_text(_dump(kustomization), encoding="utf-8")
    return written + [out_dir / "kustomization.yaml"]
