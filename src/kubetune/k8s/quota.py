"""Does a job fit in what its namespace's ResourceQuotas leave? Pure: API objects in, lines out.

A ResourceQuota caps the sum over every pod of its namespace that has not finished
(phase Succeeded or Failed), as the quota controller counts: `requests.X` and `limits.X`
from the containers (a missing request counts as its limit), `pods` by number, and
`cpu`, `memory`, `hugepages-*` alone meaning `requests.`. A pod that would go over is
refused when it is created, so a multi-pod job that does not fit starts some pods and
waits for the rest while holding them. `submit` checks a rendered job before creating
anything; `doctor` checks a live job's pods that do not exist yet. Scoped quotas (by
priority class or QoS) are left to the API server.
"""

from __future__ import annotations

from collections.abc import Iterable
from decimal import Decimal

from kubetune.contracts.kube import INSTANCE, KubeObject, parse_quantity

Usage = dict[str, Decimal]
FINISHED_PHASES = ("Succeeded", "Failed")


def _add(total: Usage, more: Usage, times: int = 1) -> Usage:
    for key, value in more.items():
        total[key] = total.get(key, Decimal(0)) + value * times
    return total


def _containers_usage(containers: Iterable[KubeObject]) -> Usage:
    usage: Usage = {}
    for container in containers:
        resources = container.get("resources") or {}
        limits = resources.get("limits") or {}
        requests = {**limits, **(resources.get("requests") or {})}  # a request defaults to its limit
        _add(usage, {f"requests.{k}": parse_quantity(v) for k, v in requests.items()})
        _add(usage, {f"limits.{k}": parse_quantity(v) for k, v in limits.items()})
    return usage


def pod_spec_usage(spec: KubeObject) -> Usage:
    """What one pod of this spec counts against a quota (init containers run before the rest)."""
    usage = _containers_usage(spec.get("containers") or [])
    for init in spec.get("initContainers") or []:
        for key, value in _containers_usage([init]).items():
            usage[key] = max(usage.get(key, Decimal(0)), value)
    usage["pods"] = Decimal(1)
    return usage


def job_usage(job: KubeObject) -> Usage:
    """Every training pod of a PyTorchJob (at its most replicas) or TrainJob, together."""
    spec = job.get("spec") or {}
    usage: Usage = {}
    if job.get("kind") == "TrainJob":
        trainer = spec.get("trainer") or {}
        pod = {"containers": [{"resources": trainer.get("resourcesPerNode") or {}}]}
        return _add(usage, pod_spec_usage(pod), int(trainer.get("numNodes") or 1))
    most = int((spec.get("elasticPolicy") or {}).get("maxReplicas") or 0)
    for role, replica_spec in (spec.get("pytorchReplicaSpecs") or {}).items():
        replicas = int(replica_spec.get("replicas") or 1)
        if role == "Worker":
            replicas = max(replicas, most)
        _add(usage, pod_spec_usage(((replica_spec.get("template") or {}).get("spec")) or {}), replicas)
    return usage


def deployment_replicas(deployment: KubeObject, objects: Iterable[KubeObject]) -> int:
    """Pods a rendered Deployment starts with: its replicas, or the minReplicas of the
    HorizontalPodAutoscaler that owns the count (what scales up later is refused by the API
    server at that time, not at submit)."""
    name = (deployment.get("metadata") or {}).get("name")
    count = int((deployment.get("spec") or {}).get("replicas") or 1)
    for obj in objects:
        spec = obj.get("spec") or {}
        if obj.get("kind") == "HorizontalPodAutoscaler" and (spec.get("scaleTargetRef") or {}).get("name") == name:
            count = max(count, int(spec.get("minReplicas") or 1))
    return count


def rendered_usage(objects: Iterable[KubeObject]) -> Usage:
    """A rendered job's pods (the training pods and the data-access pod), or a serving Deployment's."""
    objects = list(objects)
    usage: Usage = {}
    for obj in objects:
        if obj["kind"] == "Pod":
            _add(usage, pod_spec_usage(obj.get("spec") or {}))
        elif obj["kind"] in ("PyTorchJob", "TrainJob"):
            _add(usage, job_usage(obj))
        elif obj["kind"] == "Deployment":
            template = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
            _add(usage, pod_spec_usage(template), deployment_replicas(obj, objects))
    return usage


def owner(pod: KubeObject) -> str:
    """The kubetune job a pod belongs to (its instance label), else the pod's own name."""
    meta = pod.get("metadata") or {}
    return (meta.get("labels") or {}).get(INSTANCE) or f"pod {meta.get('name', '?')}"


def usage_by_owner(pods: Iterable[KubeObject]) -> dict[str, Usage]:
    """What the namespace's unfinished pods hold, per job (or per pod outside kubetune)."""
    held: dict[str, Usage] = {}
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in FINISHED_PHASES:
            continue
        _add(held.setdefault(owner(pod), {}), pod_spec_usage(pod.get("spec") or {}))
    return held


def _counted_as(key: str) -> str:
    return f"requests.{key}" if key in ("cpu", "memory") or key.startswith("hugepages-") else key


def fmt(key: str, value: Decimal) -> str:
    """Cores and counts as plain numbers (16.25), bytes in Gi (64.25Gi)."""
    if key.endswith(("memory", "storage")) or "hugepages-" in key:
        value = (value / 2**30).quantize(Decimal("0.01"))
        return f"{value.normalize():f}Gi"
    return f"{value.normalize():f}"


def _short(quota: KubeObject, held: Usage, need: Usage) -> list[tuple[str, Decimal, Decimal, Decimal]]:
    """(key, need, remaining, hard) for each capped resource this need overruns."""
    out = []
    for key, text in ((quota.get("spec") or {}).get("hard") or {}).items():
        counted, hard = _counted_as(key), parse_quantity(text)
        remaining = max(Decimal(0), hard - held.get(counted, Decimal(0)))
        if need.get(counted, Decimal(0)) > remaining:
            out.append((counted, need[counted], remaining, hard))
    requests = {k for k, *_ in out if k.startswith("requests.")}
    # limits.X says nothing more than requests.X for Guaranteed pods: one line each
    return [row for row in out if not (row[0].startswith("limits.") and "requests." + row[0][7:] in requests)]


def beyond(quota: KubeObject, need: Usage) -> list[tuple[str, Decimal, Decimal]]:
    """(key, need, hard) for each resource `need` overruns in an empty namespace: what can never fit.
    `render` refuses a job beyond the quota it renders itself; `shortfalls` adds the other pods."""
    return [(key, needed, hard) for key, needed, _, hard in _short(quota, {}, need)]


def shortfalls(
    quotas: Iterable[KubeObject], pods: Iterable[KubeObject], need: Usage, job: str, ours: bool
) -> list[str]:
    """One line per quota that `need` does not fit in. `ours`: this job's own pods already hold
    their share (doctor); otherwise they are left out, as `need` counts them again (submit)."""
    held_by = usage_by_owner(pods)
    if not ours:
        held_by.pop(job, None)
    held = _add({}, {})
    for usage in held_by.values():
        _add(held, usage)
    lines = []
    for quota in quotas:
        spec = quota.get("spec") or {}
        if spec.get("scopes") or spec.get("scopeSelector"):
            continue
        rows = _short(quota, held, need)
        if not rows:
            continue
        meta = quota.get("metadata") or {}
        parts = [f"{k} needs {fmt(k, n)}, {fmt(k, r)} of {fmt(k, h)} remain" for k, n, r, h in rows]
        keys = [k for k, *_ in rows]
        users = [
            f"{'this job' if who == job else who}: " + ", ".join(f"{k} {fmt(k, u[k])}" for k in keys if u.get(k))
            for who, u in sorted(held_by.items())
            if any(u.get(k) for k in keys)
        ]
        where = f"ResourceQuota {meta.get('namespace', '?')}/{meta.get('name', '?')}"
        lines.append(
            f"{job} does not fit in {where}: {'; '.join(parts)}" + (f" (held by {'; '.join(users)})" if users else "")
        )
    return lines


def missing(job_total: Usage, own_pods: Iterable[KubeObject]) -> Usage:
    """What a live job still needs: its whole demand less what its unfinished pods hold."""
    held = usage_by_owner(own_pods)
    have: Usage = _add({}, {})
    for usage in held.values():
        _add(have, usage)
    return {k: v - have.get(k, Decimal(0)) for k, v in job_total.items() if v > have.get(k, Decimal(0))}
