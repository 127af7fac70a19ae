"""Kueue (kueue.x-k8s.io/v1beta2): the queue a job waits in, and where its pods may land. Pure.

With k8s.queue set (and k8s.gang not volcano, whose queue it then is), the job carries Kueue's
queue-name label and is created suspended: PyTorchJob `spec.runPolicy.suspend`, TrainJob
`spec.suspend`, the fields Kueue's integrations (`kubeflow.org/pytorchjob`,
`trainer.kubeflow.org/trainjob`) set and clear. Kueue makes one Workload of every pod set and
admits it whole, once its ClusterQueue has quota for all of them, then unsuspends the job: no
pod starts before every pod can (gang admission). Created suspended rather than left to
Kueue's webhook, so that a cluster whose Kueue does not manage the kind keeps the job waiting,
visibly (`k8s doctor`), instead of starting it outside the queue.

`k8s.kueue.topology` asks for Topology-Aware Scheduling: the annotation
`kueue.x-k8s.io/podset-required-topology` (or `-preferred-topology`) on every pod set's
template, naming one of the Topology's levels.

`kubetune k8s render --kueue` also renders what a team's queue needs (`team_objects`): the
LocalQueue k8s.queue in the job's namespace, its ClusterQueue with this job's requests as
nominal quota (times k8s.kueue.quota_jobs) in one ResourceFlavor carrying the profile's node
labels, and the Topology when k8s.kueue.topology.levels is set. They are shared by every job of
the queue: written beside the job's kustomization, never in it (`render.shared`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

from kubetune.contracts.kube import KUBETUNE, KubeObject, common_labels
from kubetune.k8s import quota
from kubetune.k8s.names import KUEUE_LABEL, Names
from kubetune.recipe.k8s import K8sSection

API_VERSION = "kueue.x-k8s.io/v1beta2"
REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
PREFERRED_TOPOLOGY = "kueue.x-k8s.io/podset-preferred-topology"
TOPOLOGY_ANNOTATIONS = (REQUIRED_TOPOLOGY, PREFERRED_TOPOLOGY)
TEAM_KINDS = ("LocalQueue", "ClusterQueue", "ResourceFlavor", "Topology")
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every Namespace
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # Kueue's label on the Workload of a job


def queued(k8s: K8sSection) -> bool:
    """Kueue admits the job: k8s.queue names a LocalQueue (with gang=volcano it is Volcano's queue)."""
    return bool(k8s.queue) and k8s.gang != "volcano"


def cluster_queue_name(k8s: K8sSection) -> str:
    return k8s.kueue.cluster_queue or str(k8s.queue)


def flavor_name(k8s: K8sSection) -> str:
    return k8s.kueue.flavor or f"kubetune-{k8s.profile}"


def flavor_node_labels(k8s: K8sSection) -> dict[str, str]:
    """The nodes of this profile: k8s.node_selector, and on cpu the AMX label the workers require."""
    labels = dict(k8s.node_selector)
    if k8s.profile == "cpu" and k8s.amx_label:
        labels[k8s.amx_label] = "true"
    return labels


# ----------------------------------------------------------------------------- the recipe


def topology_request(k8s: K8sSection) -> tuple[str, str] | None:
    """(annotation, level) the pods ask Kueue for, or None."""
    topology = k8s.kueue.topology
    if topology.required:
        return REQUIRED_TOPOLOGY, topology.required
    if topology.preferred:
        return PREFERRED_TOPOLOGY, topology.preferred
    return None


def problems(k8s: K8sSection) -> list[str]:
    """What Kueue would refuse in the recipe's topology request, one line each."""
    topology = k8s.kueue.topology
    out = []
    if topology.required and topology.preferred:
        out.append(
            "k8s.kueue.topology.required and k8s.kueue.topology.preferred are both set: Kueue takes one topology "
            "request per pod set; keep one"
        )
    for key, level in (("required", topology.required), ("preferred", topology.preferred)):
        if level is None:
            continue
        if not queued(k8s):
            out.append(
                f"k8s.kueue.topology.{key} needs k8s.queue (Kueue places the pods it admits"
                + (", and with k8s.gang=volcano k8s.queue is Volcano's)" if k8s.gang == "volcano" else ")")
            )
        if not topology.levels:
            out.append(
                f"k8s.kueue.topology.{key}={level} needs k8s.kueue.topology.levels (the Topology's node labels, "
                "widest first) to check the level against"
            )
        elif level not in topology.levels:
            out.append(
                f"k8s.kueue.topology.{key}={level} is not a level of the Topology; use one of "
                f"k8s.kueue.topology.levels: {', '.join(topology.levels)}"
            )
    return out


def team_problems(k8s: K8sSection) -> list[str]:
    """What makes `render --kueue` impossible for this recipe."""
    if not k8s.queue:
        return ["--kueue renders the LocalQueue k8s.queue and its ClusterQueue: set k8s.queue (the LocalQueue's name)"]
    if k8s.gang == "volcano":
        return ["--kueue: with k8s.gang=volcano, k8s.queue is a Volcano queue; use k8s.gang=none or coscheduling"]
    if k8s.kueue.topology.levels and not flavor_node_labels(k8s):
        line = (
            "--kueue with k8s.kueue.topology.levels: a ResourceFlavor of a Topology needs node labels; set "
            "k8s.node_selector to a label every training node carries"
        )
        return [line]
    return []


def team_warnings(k8s: K8sSection) -> list[str]:
    """What `render --kueue`'s quota leaves out."""
    if k8s.devices != "dra":
        return []
    line = (
        "--kueue with k8s.devices=dra: the pods claim their cards (ResourceClaims), request none, so the "
        "ClusterQueue quotas their cpu, memory and hugepages only; Kueue counts claimed devices only where its "
        "own DRA support is configured"
    )
    return [line]


# ----------------------------------------------------------------------------- the job


def pod_templates(job: KubeObject) -> Iterator[tuple[str, KubeObject]]:
    """(path, pod template) of every pod set this job gives Kueue: a PyTorchJob's replica specs,
    the pod templates a TrainJob patches into its runtime's replicated jobs (the job's own dicts)."""
    spec = job.get("spec") or {}
    if job.get("kind") == "PyTorchJob":
        for role, replica in (spec.get("pytorchReplicaSpecs") or {}).items():
            if isinstance(replica.get("template"), dict):
                yield f"spec/pytorchReplicaSpecs/{role}/template", replica["template"]
    elif job.get("kind") == "TrainJob":
        for i, patch in enumerate(spec.get("runtimePatches") or []):
            replicated = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}
            for j, rj in enumerate(replicated.get("replicatedJobs") or []):
                template = ((rj.get("template") or {}).get("spec") or {}).get("template")
                if isinstance(template, dict):
                    where = f"spec/runtimePatches/{i}/trainingRuntimeSpec/template/spec/replicatedJobs/{j}"
                    yield f"{where}/template/spec/template", template


def _suspend_holder(job: KubeObject) -> KubeObject:
    """The mapping whose `suspend` Kueue reads: PyTorchJob runPolicy, TrainJob spec."""
    spec = job.setdefault("spec", {})
    return spec.setdefault("runPolicy", {}) if job["kind"] == "PyTorchJob" else spec


def through_queue(job: KubeObject, k8s: K8sSection) -> KubeObject:
    """The job as Kueue admits it: suspended, every pod set carrying the topology request."""
    if not queued(k8s):
        return job
    job = copy.deepcopy(job)
    _suspend_holder(job)["suspend"] = True
    request = topology_request(k8s)
    if request is not None:
        for _, template in pod_templates(job):
            meta = template.setdefault("metadata", {})
            meta["annotations"] = {**(meta.get("annotations") or {}), request[0]: request[1]}
    return job


def without_suspend(job: KubeObject) -> KubeObject:
    """A rendered job for re-applying over the live one: Kueue owns `suspend` once the job exists
    (unsuspended on admission); writing it back would evict an admitted job."""
    if job.get("kind") not in ("PyTorchJob", "TrainJob"):
        return job
    job = copy.deepcopy(job)
    _suspend_holder(job).pop("suspend", None)
    return job


# ----------------------------------------------------------------------------- the team's objects


def _meta(name: str, namespace: str | None = None) -> KubeObject:
    # No instance label: shared by every job of the queue, so deleting one job leaves them.
    meta: KubeObject = {"name": name, "labels": common_labels(KUBETUNE, "queue", managed_by=KUBETUNE)}
    if namespace:
        meta["namespace"] = namespace
    return meta


def _nominal_quota(job: KubeObject, jobs: int) -> list[tuple[str, str]]:
    """(resource, quantity) of every resource the job's pods request, times `jobs`."""
    from kubetune.k8s.objects import _format_quantity  # one formatter of quantities for rendered objects

    out = []
    for key, value in quota.job_usage(job).items():
        if key.startswith("requests."):
            resource = key.removeprefix("requests.")
            binary = resource != "cpu" and "/" not in resource
            out.append((resource, _format_quantity(value * jobs, binary)))
    return out


def team_objects(k8s: K8sSection, names: Names, job: KubeObject) -> list[KubeObject]:
    """LocalQueue, ClusterQueue, ResourceFlavor and, with levels, the Topology: in apply order
    (what is referenced first)."""
    topology = k8s.kueue.topology
    out: list[KubeObject] = []
    flavor_spec: KubeObject = {}
    if labels := flavor_node_labels(k8s):
        flavor_spec["nodeLabels"] = labels
    if topology.levels:
        levels = [{"nodeLabel": level} for level in topology.levels]
        out.append(
            {
                "apiVersion": API_VERSION,
                "kind": "Topology",
                "metadata": _meta(topology.name),
                "spec": {"levels": levels},
            }
        )
        flavor_spec["topologyName"] = topology.name
    flavor = flavor_name(k8s)
    out.append({"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": _meta(flavor), "spec": flavor_spec})
    quotas = _nominal_quota(job, k8s.kueue.quota_jobs)
    group = {
        "coveredResources": [resource for resource, _ in quotas],
        "flavors": [{"name": flavor, "resources": [{"name": r, "nominalQuota": q} for r, q in quotas]}],
    }
    cluster_queue = {
        "apiVersion": API_VERSION,
        "kind": "ClusterQueue",
        "metadata": _meta(cluster_queue_name(k8s)),
        "spec": {
            "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: names.namespace}},
            "resourceGroups": [group],
        },
    }
    local_queue = {
        "apiVersion": API_VERSION,
        "kind": "LocalQueue",
        "metadata": _meta(str(k8s.queue), names.namespace),
        "spec": {"clusterQueue": cluster_queue_name(k8s)},
    }
    return out + [cluster_queue, local_queue]


def is_team_object(obj: KubeObject) -> bool:
    return str(obj.get("apiVersion", "")).startswith("kueue.x-k8s.io/") and obj.get("kind") in TEAM_KINDS


# ----------------------------------------------------------------------------- checks


def topology_problems(objects: list[KubeObject]) -> list[str]:
    """Every topology annotation of a job names a level of a Topology rendered with it (when one is)."""
    levels = {
        level["nodeLabel"]
        for obj in objects
        if obj.get("kind") == "Topology" and is_team_object(obj)
        for level in (obj.get("spec") or {}).get("levels") or []
    }
    if not levels:
        return []
    out = []
    for obj in objects:
        if obj.get("kind") not in ("PyTorchJob", "TrainJob"):
            continue
        for where, template in pod_templates(obj):
            for key, value in ((template.get("metadata") or {}).get("annotations") or {}).items():
                if key in TOPOLOGY_ANNOTATIONS and value not in levels:
                    out.append(
                        f"{obj['kind']}/{obj['metadata']['name']}: {where}/metadata/annotations/{key}: {value} is not "
                        f"a level of the Topology ({', '.join(sorted(levels))})"
                    )
    return out


# ----------------------------------------------------------------------------- the Workload


def workload_of(workloads: list[KubeObject], job: KubeObject) -> KubeObject | None:
    """The Workload Kueue made for `job`: owned by it, or labelled with its uid."""
    kind, name = job.get("kind"), (job.get("metadata") or {}).get("name")
    uid = (job.get("metadata") or {}).get("uid")
    for workload in workloads:
        meta = workload.get("metadata") or {}
        owners = meta.get("ownerReferences") or []
        if any(o.get("kind") == kind and o.get("name") == name for o in owners):
            return workload
        if uid and (meta.get("labels") or {}).get(JOB_UID_LABEL) == uid:
            return workload
    return None


def queue_of(job: KubeObject) -> str | None:
    return ((job.get("metadata") or {}).get("labels") or {}).get(KUEUE_LABEL)
