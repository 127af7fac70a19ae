"""Submit a rendered job and follow it: status, logs, download, delete.

The commands (`submit`, `status`, `logs`, `download`, `delete`) take a `KubeClient` (the
only API boundary) and return data or text lines; the CLI prints them. The helpers that
read a fetched object (`job_state`, `pod_rank`, ...) are pure. Object names come from
`names.Names` and training pods are found by their labels (`names.trainer_selector`), so
these commands need only the job name and namespace, not the recipe; `delete --purge`
removes a PVC or runtime only when its labels say this job's kubetune made it. The serving
objects of a run (`render-serve`, an instance named `<job>-serve`) go through the same
commands: `submit` applies them, `status NAME` shows the Deployment's pods and autoscaler,
`delete NAME` removes every serving object labelled with that instance.
"""

from __future__ import annotations

import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import yaml

from kubetune.contracts.kube import COMPONENT, INSTANCE, KUBETUNE, MANAGED_BY
from kubetune.errors import RecipeError, UserError
from kubetune.k8s import kueue, progress, quota
from kubetune.k8s.names import (
    CONTAINER,
    DATA_DIR,
    NAMESPACE_QUOTA,
    RECIPE_KEY,
    ROLLOUT_SUFFIX,
    SERVING_COMPONENTS,
    Names,
    server_selector,
    trainer_selector,
)
from kubetune.k8s.objects import config_map_recipe
from kubetune.k8s.render import Rendered
from kubetune.k8s.scrape import pod_monitor_name
from kubetune.kubeapi import KubeClient, NotFound
from kubetune.recipe.loader import _flatten
from kubetune.recipe.schema import Recipe
from kubetune.rundir import changed_keys

MONITORING_API = "monitoring.coreos.com/v1"
JOB_KINDS = (("kubeflow.org/v1", "PyTorchJob", "pytorchjob"), ("trainer.kubeflow.org/v1alpha1", "TrainJob", "trainjob"))
POD_GROUP_KINDS = (("scheduling.x-k8s.io/v1alpha1", "PodGroup"), ("scheduling.volcano.sh/v1beta1", "PodGroup"))
# a changed spec needs delete + create, not a patch
IMMUTABLE_KINDS = {"Pod", "PersistentVolumeClaim", "ResourceClaimTemplate"}
# What `render-serve` makes, in the order `delete` removes it (the Deployment first: its pods go with it)
SERVING_KINDS = (
    ("apps/v1", "Deployment"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "Ingress"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    (MONITORING_API, "ServiceMonitor"),
    ("resource.k8s.io/v1", "ResourceClaimTemplate"),  # k8s.devices=dra: after the pods that claim from it
)
FINISHED = {"Succeeded", "Complete", "Failed"}
NO_MONITORING_CRDS = (
    "the cluster has no Prometheus Operator CRDs (install kube-prometheus-stack, or set monitor.in_cluster=false); "
    "the pods still serve /metrics"
)


# ------------------------------------------------------------------------------ submit


def submit(client: KubeClient, rendered: Rendered) -> list[str]:
    """Create or update every rendered object, in order; one line per object. Refuses, before
    creating anything, a job that does not fit in what the namespace's quotas leave, and a
    recipe that changes what a job submitted before learns."""
    lines = check_quotas(client, rendered)
    check_recipe_change(client, rendered)
    for obj in rendered.objects:
        where = _ref(obj)
        if obj["kind"] == "Namespace":
            lines.append(f"{_ensure_namespace(client, obj)} {where}")
            continue
        budget = _is_namespace_quota(obj)
        queued_job = obj is rendered.job and kueue.queue_of(obj)
        if queued_job and client.get(obj["apiVersion"], obj["kind"], obj["metadata"]["name"], rendered.names.namespace):
            obj = kueue.without_suspend(obj)  # Kueue unsuspended it on admission: suspending it again would evict it
        try:
            action = client.apply(obj, immutable=obj["kind"] in IMMUTABLE_KINDS or budget)
        except NotFound:
            if obj["apiVersion"] != MONITORING_API:
                raise
            lines.append(f"skipped {where}: {NO_MONITORING_CRDS}")
            continue
        note = ""
        if action == "kept" and budget:
            note = (
                " (the namespace's budget stays as it is, whatever one job's recipe says; change it with "
                f"`kubectl edit resourcequota {NAMESPACE_QUOTA} -n {rendered.names.namespace}`)"
            )
        elif action == "kept":
            note = (
                f" (a {obj['kind']} cannot change in place; "
                f"`kubetune k8s delete {rendered.names.job} -n {rendered.names.namespace} --purge` recreates it)"
            )
        lines.append(f"{action} {where}{note}")
    job = rendered.job
    if job["kind"] not in {kind for _, kind, _ in JOB_KINDS}:  # serving objects: nothing finishes
        return lines
    state = job_state(client.get(job["apiVersion"], job["kind"], job["metadata"]["name"], rendered.names.namespace))
    if state in FINISHED:
        lines.append(
            f"note: {job['kind']} {rendered.names.job} already finished ({state}); "
            f"`kubetune k8s delete {rendered.names.job} -n {rendered.names.namespace}` and submit again to rerun "
            "(the PVC and its checkpoints stay)"
        )
    return lines


def check_recipe_change(client: KubeClient, rendered: Rendered) -> None:
    """Raise a UserError when the job was submitted before with a recipe that learns something
    else: its pods would take the new one at their next start and stop there ("a different
    recipe", `RunDir.claim`). The operator refuses such an edit of a FineTune by the same rule
    (`rundir.changed_keys`); a change that keeps the run resumable goes through."""
    names = rendered.names
    ours = [o for o in rendered.objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == names.recipe]
    submitted = ours[0] if ours else None  # serving objects have no recipe
    live = client.get("v1", "ConfigMap", names.recipe, names.namespace) if submitted else None
    if submitted is None or live is None or RECIPE_KEY not in (live.get("data") or {}):
        return
    try:
        running = config_map_recipe(live)
    except RecipeError:  # not a recipe this release reads (hand-edited, or an older schema's): replaced
        return
    new = config_map_recipe(submitted)
    learned = changed_keys(running, new)[1]
    if learned:
        raise UserError(_not_resumable(names, running, new, learned))


def _not_resumable(names: Names, running: Recipe, new: Recipe, learned: list[str]) -> str:
    before, after = _flatten(running.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    shown = ", ".join(f"{k} ({before.get(k)} -> {after.get(k)})" for k in learned[:3])
    shown += f" and {len(learned) - 3} more" if len(learned) > 3 else ""
    job, ns, out = names.job, names.namespace, running.output_dir
    if names.owns_pvc:
        delete = f"`kubetune k8s delete {job} -n {ns} --purge` first (its checkpoints go too)"
    else:
        delete = f"`kubetune k8s delete {job} -n {ns}` and remove {out} from claim {names.pvc} first"
    return (
        f"job {job} in namespace {ns} was submitted with another recipe, and changing {shown} changes what is "
        f"learned: its pods could not resume from their checkpoints in {out}; nothing was submitted: give the new "
        f"recipe a job of its own (another output_dir=... or k8s.name=...), or {delete}"
    )


def _is_namespace_quota(obj: dict) -> bool:
    return obj["kind"] == "ResourceQuota" and obj["metadata"]["name"] == NAMESPACE_QUOTA


def check_quotas(client: KubeClient, rendered: Rendered) -> list[str]:
    """Raise a UserError when the job does not fit beside the namespace's other pods; notes otherwise."""
    from kubetune.kubeapi import ClusterError

    ns, job = rendered.names.namespace, rendered.names.job
    try:
        live = client.list("v1", "ResourceQuota", ns)
        pods = (
            client.list("v1", "Pod", ns) if live or any(o["kind"] == "ResourceQuota" for o in rendered.objects) else []
        )
    except ClusterError as e:
        return [f"note: quotas not checked ({e})"]
    quotas = {q["metadata"]["name"]: q for q in live}
    for obj in rendered.objects:
        if obj["kind"] == "ResourceQuota" and not (_is_namespace_quota(obj) and obj["metadata"]["name"] in quotas):
            quotas[obj["metadata"]["name"]] = obj  # created now, or (a per-job quota) updated to this
    short = quota.shortfalls(quotas.values(), pods, quota.rendered_usage(rendered.objects), job, ours=False)
    if short:
        raise UserError(
            *short,
            f"nothing was submitted: wait for those jobs to finish (`kubetune k8s status NAME -n {ns}`), make this "
            "one smaller (k8s.replicas, k8s.resources.*), or raise the quota (k8s.namespace_quota.* when creating "
            f"it, `kubectl edit resourcequota NAME -n {ns}` once it exists)",
        )
    return []


def _ensure_namespace(client: KubeClient, obj: dict) -> str:
    from kubetune.kubeapi import ClusterError

    try:
        if client.get("v1", "Namespace", obj["metadata"]["name"]) is not None:
            return "unchanged"
    except ClusterError:
        # Namespace-scoped users often may not read namespaces: assume it is there and let
        # the next object's error speak if it is not.
        return "assumed present"
    client.create(obj)
    return "created"


def _ref(obj: dict) -> str:
    meta = obj["metadata"]
    return f"{obj['kind']} {meta['namespace'] + '/' if meta.get('namespace') else ''}{meta['name']}"


# ------------------------------------------------------------------------------ reading


def find_job(client: KubeClient, name: str, namespace: str) -> dict:
    for api_version, kind, _ in JOB_KINDS:
        job = client.get(api_version, kind, name, namespace)
        if job is not None:
            return job
    raise UserError(
        f"no PyTorchJob or TrainJob named {name} in namespace {namespace} "
        "(check the name with `kubectl get pytorchjobs,trainjobs -A`, or pass -n NAMESPACE)"
    )


def job_api(job: dict) -> str:
    return "pytorchjob" if job["kind"] == "PyTorchJob" else "trainjob"


def job_state(job: dict | None) -> str | None:
    """The newest condition that holds (Created, Running, Succeeded, Failed, Complete, ...)."""
    if not job:
        return None
    conditions = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    return conditions[-1]["type"] if conditions else None


def has_master(job: dict | None) -> bool:
    """Elastic PyTorchJobs have Workers only; then worker i is node rank i, not i + 1."""
    return "Master" in ((job or {}).get("spec") or {}).get("pytorchReplicaSpecs", {"Master": None})


def pod_rank(pod: dict, with_master: bool = True) -> int | None:
    """Node rank from the labels each operator puts on its pods."""
    labels = pod["metadata"].get("labels") or {}
    if "training.kubeflow.org/replica-type" in labels:  # Training Operator v1
        kind = labels["training.kubeflow.org/replica-type"].lower()
        index = int(labels.get("training.kubeflow.org/replica-index", 0))
        return 0 if kind == "master" else index + (1 if with_master else 0)
    for key in ("batch.kubernetes.io/job-completion-index", "jobset.sigs.k8s.io/job-index"):  # Trainer v2
        if key in labels:
            return int(labels[key])
    return None


def trainer_pods(client: KubeClient, name: str, namespace: str, job: dict | None = None) -> list[dict]:
    """The job's training pods, ordered by rank (unknown ranks last, by name)."""
    pods = client.list("v1", "Pod", namespace, trainer_selector(name))
    master = has_master(job)
    return sorted(pods, key=lambda p: (pod_rank(p, master) is None, pod_rank(p, master) or 0, p["metadata"]["name"]))


def _pod_detail(pod: dict) -> str:
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason") not in (None, "ContainerCreating"):
            return waiting["reason"]
        terminated = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
        if terminated and terminated.get("reason") not in (None, "Completed"):
            return f"last exit: {terminated['reason']} ({terminated.get('exitCode')})"
    for cond in status.get("conditions") or []:
        if cond.get("status") == "False" and cond.get("reason"):
            return f"{cond['reason']}: {cond.get('message', '')}".strip()
    return ""


def _restarts(pod: dict) -> int:
    return sum(cs.get("restartCount", 0) for cs in (pod.get("status") or {}).get("containerStatuses") or [])


def run_output_dir(client: KubeClient, name: str, namespace: str) -> str:
    """output_dir as the pods see it, from the recipe ConfigMap (render's default otherwise)."""
    cm = client.get("v1", "ConfigMap", Names.for_job(name, namespace).recipe, namespace)
    try:
        return str(yaml.safe_load((cm or {})["data"][RECIPE_KEY])["output_dir"])
    except (TypeError, KeyError, yaml.YAMLError):
        return f"{DATA_DIR}/runs/{name}"


def read_progress(
    client: KubeClient, name: str, namespace: str, job: dict, pods: list[dict]
) -> progress.Progress | None:
    """From the rank-0 log tail; else from metrics.jsonl on the PVC through the data-access pod."""
    from kubetune.kubeapi import ClusterError

    api = job_api(job)
    rank0 = next((p for p in pods if pod_rank(p, has_master(job)) == 0), None)
    if rank0 and (rank0.get("status") or {}).get("phase") in ("Running", "Succeeded", "Failed"):
        try:
            found = progress.from_log(
                client.pod_log(rank0["metadata"]["name"], namespace, CONTAINER[api], tail_lines=400)
            )
            if found:
                return found
        except ClusterError:
            pass
    try:
        text = exec_text(
            client, name, namespace, ["tail", "-n", "5", f"{run_output_dir(client, name, namespace)}/metrics.jsonl"]
        )
    except ClusterError:
        return None
    return progress.from_metrics(text)


def exec_text(client: KubeClient, name: str, namespace: str, command: list[str]) -> str:
    with tempfile.TemporaryFile() as sink:
        client.exec_to(Names.for_job(name, namespace).data_pod, namespace, command, sink, container="data")
        sink.seek(0)
        return sink.read().decode("utf-8", "replace")


@dataclass
class Status:
    job: dict | None
    pods: list[dict]
    progress: progress.Progress | None = None
    lines: list[str] = field(default_factory=list)
    deployment: dict | None = None


def status(client: KubeClient, name: str, namespace: str) -> Status:
    """A training job's status, a serving Deployment's (`render-serve`), or both when both are named so."""
    deployment = client.get("apps/v1", "Deployment", name, namespace)
    if deployment is not None and not _labelled(deployment, name):
        deployment = None  # someone else's Deployment of that name
    if deployment is not None and not any(client.get(av, kind, name, namespace) for av, kind, _ in JOB_KINDS):
        return Status(
            job=None, pods=[], lines=serving_lines(client, name, namespace, deployment), deployment=deployment
        )
    st = _job_status(client, name, namespace)
    if deployment is not None:
        st.deployment = deployment
        st.lines += serving_lines(client, name, namespace, deployment)
    return st


def _job_status(client: KubeClient, name: str, namespace: str) -> Status:
    job = find_job(client, name, namespace)
    pods = trainer_pods(client, name, namespace, job)
    st = Status(job=job, pods=pods, progress=read_progress(client, name, namespace, job, pods))
    conditions = (job.get("status") or {}).get("conditions") or []
    st.lines.append(f"{job['kind']} {namespace}/{name}: {job_state(job) or 'Pending (no conditions yet)'}")
    if conditions:
        st.lines.append("conditions: " + ", ".join(f"{c['type']}={c.get('status')}" for c in conditions))
        last = conditions[-1]
        if last.get("message") and last.get("status") == "True":
            st.lines.append(f"  {last['type']}: {last['message']}")
    st.lines.append(f"{'rank':<5} {'pod':<44} {'phase':<10} {'node':<20} {'restarts':<8} detail")
    for pod in pods:
        rank = pod_rank(pod, has_master(job))
        phase = (pod.get("status") or {}).get("phase", "?")
        node = (pod.get("spec") or {}).get("nodeName") or "-"
        st.lines.append(
            f"{'?' if rank is None else rank:<5} {pod['metadata']['name']:<44} {phase:<10} {node:<20} "
            f"{_restarts(pod):<8} {_pod_detail(pod)}".rstrip()
        )
    if not pods:
        st.lines.append(f"(no training pods yet: `kubetune k8s doctor {name} -n {namespace}` explains why)")
    st.lines.append("progress: " + (progress.describe(st.progress) if st.progress else "no progress reported yet"))
    return st


# ------------------------------------------------------------------------------ serving


def _labelled(obj: dict, name: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(INSTANCE) == name and labels.get(MANAGED_BY) == KUBETUNE


def _ready(pod: dict) -> bool:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return bool(statuses) and all(cs.get("ready") for cs in statuses)


def _metric_text(metric: dict) -> str:
    """One HPA metric of status.currentMetrics: `vllm_num_requests_waiting 1.5`, `cpu 35%`."""
    if metric.get("type") == "Pods":
        pods = metric.get("pods") or {}
        return f"{(pods.get('metric') or {}).get('name', '?')} {(pods.get('current') or {}).get('averageValue', '?')}"
    resource = metric.get("resource") or {}
    current = resource.get("current") or {}
    if "averageUtilization" in current:
        return f"{resource.get('name', '?')} {current['averageUtilization']}%"
    return f"{resource.get('name', '?')} {current.get('averageValue', '?')}"


def _autoscaler_lines(hpa: dict) -> list[str]:
    spec, st = hpa.get("spec") or {}, hpa.get("status") or {}
    line = (
        f"autoscaler: {st.get('currentReplicas', '?')} replicas, wants {st.get('desiredReplicas', '?')} "
        f"({spec.get('minReplicas', 1)}..{spec.get('maxReplicas', '?')})"
    )
    current = [m for m in st.get("currentMetrics") or [] if m]
    if current:
        line += "; now " + ", ".join(_metric_text(m) for m in current)
    lines = [line]
    for cond in st.get("conditions") or []:
        if cond.get("status") == "False" and cond.get("type") in ("AbleToScale", "ScalingActive"):
            lines.append(f"  {cond['type']}=False: {cond.get('reason', '')} {cond.get('message', '')}".rstrip())
    wants_pods_metric = any(m.get("type") == "Pods" for m in spec.get("metrics") or [])
    if wants_pods_metric and st and not any(m.get("type") == "Pods" for m in current):
        lines.append(
            "  the waiting-queue metric is not readable (no custom metrics API, or prometheus-adapter lacks the "
            f"rule of ConfigMap {hpa['metadata']['name']}-prometheus-adapter-rule): it scales up on CPU only"
        )
    return lines


def serving_lines(client: KubeClient, name: str, namespace: str, deployment: dict) -> list[str]:
    """The Deployment's ready replicas, its autoscaler, each pod, and where it answers."""
    spec, st = deployment.get("spec") or {}, deployment.get("status") or {}
    want = st.get("replicas", spec.get("replicas", "?"))
    head = (
        f"Deployment {namespace}/{name}: {st.get('readyReplicas', 0)}/{want} ready "
        f"({st.get('updatedReplicas', 0)} up to date, {st.get('availableReplicas', 0)} available)"
    )
    lines = [head]
    hpa = client.get("autoscaling/v2", "HorizontalPodAutoscaler", name, namespace)
    if hpa is not None:
        lines += _autoscaler_lines(hpa)
    pods = sorted(client.list("v1", "Pod", namespace, server_selector(name)), key=lambda p: p["metadata"]["name"])
    lines.append(f"{'pod':<50} {'phase':<10} {'ready':<6} {'node':<20} {'restarts':<8} detail")
    for pod in pods:
        phase = (pod.get("status") or {}).get("phase", "?")
        node = (pod.get("spec") or {}).get("nodeName") or "-"
        ready = "yes" if _ready(pod) else "no"
        lines.append(
            f"{pod['metadata']['name']:<50} {phase:<10} {ready:<6} {node:<20} {_restarts(pod):<8} "
            f"{_pod_detail(pod)}".rstrip()
        )
    if not pods:
        lines.append("(no serving pods yet)")
    lines.append(f"endpoint: {_endpoint(client, name, namespace)}")
    return lines


def _endpoint(client: KubeClient, name: str, namespace: str) -> str:
    """Where clients reach it: the Ingress's host or address, and the Service inside the cluster."""
    svc = client.get("v1", "Service", name, namespace)
    ports = ((svc or {}).get("spec") or {}).get("ports") or [{}]
    inside = f"http://{name}.{namespace}.svc:{ports[0].get('port', '?')}/v1 in the cluster"
    ingress = client.get("networking.k8s.io/v1", "Ingress", name, namespace) or {}
    hosts = [r["host"] for r in (ingress.get("spec") or {}).get("rules") or [] if r.get("host")]
    balancers = ((ingress.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    addresses = [a.get("hostname") or a.get("ip") for a in balancers if a.get("hostname") or a.get("ip")]
    outside = (hosts or addresses or [None])[0]
    return f"http://{outside}/v1 (Ingress), {inside}" if outside else f"{inside} (the Ingress has no address yet)"


def logs(
    client: KubeClient, name: str, namespace: str, rank: int = 0, follow: bool = False, tail_lines: int | None = None
) -> Iterator[str]:
    job = find_job(client, name, namespace)
    pods = [p for p in trainer_pods(client, name, namespace, job) if pod_rank(p, has_master(job)) == rank]
    if not pods:
        raise UserError(
            f"no pod of rank {rank} for {name} in {namespace} (see `kubetune k8s status {name} -n {namespace}`)"
        )
    return client.pod_log(
        pods[0]["metadata"]["name"], namespace, CONTAINER[job_api(job)], tail_lines=tail_lines, follow=follow
    )


# ------------------------------------------------------------------------------ download / delete


def download(client: KubeClient, name: str, namespace: str, out_dir: Path) -> Path:
    """Copy the run's output directory out of the data-access pod (tar over exec, like kubectl cp)."""
    names = Names.for_job(name, namespace)
    pod = client.get("v1", "Pod", names.data_pod, namespace)
    phase = (pod or {}).get("status", {}).get("phase")
    if phase != "Running":
        raise UserError(
            f"the data-access pod {namespace}/{names.data_pod} is {phase or 'missing'}: "
            f"`kubetune k8s submit RECIPE -n {namespace}` (re)creates it"
        )
    remote = PurePosixPath(run_output_dir(client, name, namespace))
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as sink:  # on disk, not in memory: runs hold GBs of checkpoints
        client.exec_to(
            names.data_pod, namespace, ["tar", "cf", "-", "-C", str(remote.parent), remote.name], sink, container="data"
        )
        sink.seek(0)
        try:
            with tarfile.open(fileobj=sink, mode="r:") as tar:
                tar.extractall(out_dir, filter="data")  # refuses absolute paths, `..` and devices
        except tarfile.TarError as e:
            raise UserError(f"the archive of {remote} from {names.data_pod} is unreadable: {e}") from None
    return out_dir / remote.name


def _ours(obj: dict | None, name: str) -> bool:
    labels = ((obj or {}).get("metadata") or {}).get("labels") or {}
    return labels.get(INSTANCE) == name and labels.get(MANAGED_BY) == KUBETUNE


def serving_targets(client: KubeClient, name: str, namespace: str) -> list[tuple[str, str, str, str | None]]:
    """Every serving object kubetune made for the instance `name` (found by its labels)."""
    labels = {INSTANCE: name, MANAGED_BY: KUBETUNE}
    return [
        (api_version, kind, obj["metadata"]["name"], namespace)
        for api_version, kind in SERVING_KINDS
        for obj in client.list(api_version, kind, namespace, labels)
        if ((obj["metadata"].get("labels") or {}).get(COMPONENT)) in SERVING_COMPONENTS
    ]


def delete(client: KubeClient, name: str, namespace: str, purge: bool = False) -> list[str]:
    """Job, its pods, PodGroup, recipe and token; with purge also the data pod, PVC, quota, runtime.
    Serving objects labelled with this instance (`render-serve`) go too, and the job's GRPO rollout
    server (`<job>-rollout`), which serves nobody once its trainer is gone."""
    names = Names.for_job(name, namespace)
    serving = serving_targets(client, name, namespace) + serving_targets(client, f"{name}{ROLLOUT_SUFFIX}", namespace)
    targets: list[tuple[str, str, str, str | None]] = [(av, kind, name, namespace) for av, kind, _ in JOB_KINDS]
    targets += [(av, kind, name, namespace) for av, kind in POD_GROUP_KINDS]
    targets += [
        ("v1", "Pod", p["metadata"]["name"], namespace)
        for p in client.list("v1", "Pod", namespace, trainer_selector(name))
    ]
    targets += [("v1", "ConfigMap", names.recipe, namespace), ("v1", "Secret", names.secret, namespace)]
    targets.append(("resource.k8s.io/v1", "ResourceClaimTemplate", names.claim_template, namespace))
    targets.append((MONITORING_API, "PodMonitor", pod_monitor_name(name), namespace))
    if purge:
        targets += [("v1", "Pod", names.data_pod, namespace), ("v1", "ResourceQuota", names.quota, namespace)]
        # Only what kubetune created for this job: never a user's existing claim or runtime.
        pvc = client.get("v1", "PersistentVolumeClaim", names.pvc, namespace)
        if _ours(pvc, name):
            targets.append(("v1", "PersistentVolumeClaim", names.pvc, namespace))
        runtime = client.get("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime", names.runtime)
        if _ours(runtime, name):
            targets.append(("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime", names.runtime, None))
    lines = [_deleted(kind, ns, obj) for av, kind, obj, ns in serving if client.delete(av, kind, obj, ns)]
    job_lines = [_deleted(kind, ns, obj) for av, kind, obj, ns in targets if client.delete(av, kind, obj, ns)]
    lines += job_lines
    if not purge and job_lines and client.get("v1", "Pod", names.data_pod, namespace) is not None:
        lines.append(
            f"kept the PVC and data-access pod {names.data_pod} (download with "
            f"`kubetune k8s download {name} -n {namespace}`; remove with --purge)"
        )
    return lines or [f"nothing named {name} in namespace {namespace}"]


def _deleted(kind: str, namespace: str | None, name: str) -> str:
    return f"deleted {kind} {namespace + '/' if namespace else ''}{name}"
