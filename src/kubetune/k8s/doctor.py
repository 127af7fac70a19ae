"""`kubetune k8s doctor`: why a job is stuck or failing, and the fix for each finding.

`collect` reads a `Snapshot` through the client; `diagnose` is pure (snapshot -> findings),
so every rule is tested with plain dicts. The rules, in the order they are reported:

| symptom (where it is seen) | finding |
|---|---|
| FailedScheduling "Insufficient cpu/memory/<accelerator>/hugepages-2Mi" (events) | more asked than any node has free |
| FailedScheduling "didn't match Pod's node affinity/selector" | no node carries k8s.node_selector / the AMX label |
| FailedScheduling "untolerated taint {k: v}" | the nodes are tainted; add k8s.tolerations |
| PVC Pending; ProvisioningFailed / FailedBinding (events), missing StorageClass | storage cannot be provisioned |
| container waiting ImagePullBackOff / ErrImagePull | image name, tag or pull secret |
| container waiting CreateContainerConfigError | a ConfigMap / Secret the pod needs is missing |
| container terminated OOMKilled (now or last) | memory limit reached |
| container waiting CrashLoopBackOff | the process keeps failing: its last log lines |
| log lines: the Hub's 401 / 403 / GatedRepoError | the Hugging Face token is missing or has no access to the model |
| log lines: rendezvous / TCPStore / connect timeouts | workers cannot reach the master |
| log lines: collective (NCCL/gloo/HCCL) timeouts | a collective timed out |
| CCL_* / I_MPI_* in the pods' env or comm.extra_env | oneCCL / Intel MPI settings nothing reads |
| pods missing and the namespace's ResourceQuotas lack room (or FailedCreate "exceeded quota") | the job does not fit |
| job condition Failed | the operator's reason |
| no pods for a job that is not suspended | operator missing, or waiting in a Kueue queue |
| suspended in a Kueue queue: no LocalQueue, no Workload, its conditions | Kueue's reason and message, the fix |
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any

from kubetune.contracts.findings import Finding, worst_first
from kubetune.k8s import kueue, quota
from kubetune.k8s.names import KUEUE_LABEL, TOKEN_KEY, Names
from kubetune.recipe.comm import ACCELERATOR_KINDS, oneccl_advice, oneccl_variables
from kubetune.recipe.schema import OFFLOADS, RECOMPUTES


@dataclass
class Snapshot:
    name: str
    namespace: str
    job: dict | None
    pods: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    pvc: dict | None = None
    storage_class_missing: str | None = None  # the PVC's class when the cluster has no such StorageClass
    logs: dict[str, list[str]] = field(default_factory=dict)  # pod name -> last lines
    recipe: dict = field(default_factory=dict)  # the ConfigMap's recipe (for the values fixes mention)
    quotas: list[dict] = field(default_factory=list)  # the namespace's ResourceQuotas
    namespace_pods: list[dict] = field(default_factory=list)  # every pod of the namespace (what quotas count)
    workload: dict | None = None  # the Kueue Workload of a queued job
    local_queue_missing: bool = False  # the job's Kueue LocalQueue does not exist
    kueue_read: bool = False  # the two above were read (a client without rights on Kueue's API reads neither)


def _get(d: object, dotted: str, default: object = "?") -> Any:
    """`d["a"]["b"]` for dotted="a.b", or `default` where a level is missing or not a mapping."""
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return default
        d = d[part]
    return d


# ----------------------------------------------------------------------------- scheduling

_INSUFFICIENT = re.compile(r"Insufficient ([\w./-]*\w)")
_TAINT = re.compile(r"untolerated taint[s]? \{([^}]*)\}")


def _insufficient_fix(resource: str, recipe: dict) -> str:
    if resource == "cpu":
        return (
            f"lower k8s.resources.cpu (now {_get(recipe, 'k8s.resources.cpu')}) or add nodes with more allocatable "
            "CPU (`kubectl describe nodes`, Allocatable minus Allocated)"
        )
    if resource == "memory":
        return (
            f"lower k8s.resources.memory (now {_get(recipe, 'k8s.resources.memory')}) or add nodes with more "
            "allocatable memory"
        )
    if resource.startswith("hugepages"):
        return (
            "pre-allocate 2Mi huge pages on the nodes (sysctl vm.nr_hugepages, then restart the kubelet) or lower "
            f"k8s.resources.hugepages_2mi (now {_get(recipe, 'k8s.resources.hugepages_2mi')})"
        )
    if "/" in resource:
        return (
            f"no node has {resource} free: check the device plugin runs on the accelerator nodes "
            f"(`kubectl get nodes -o custom-columns=NAME:.metadata.name,{resource}:.status.allocatable`), wait for "
            f"other jobs, or lower k8s.resources.accelerators (now {_get(recipe, 'k8s.resources.accelerators')})"
        )
    return f"free or add {resource} on the nodes, or ask for less"


def _scheduling_findings(pod: str, message: str, recipe: dict) -> list[Finding]:
    out = []
    for resource in dict.fromkeys(_INSUFFICIENT.findall(message)):
        out.append(
            Finding(
                "error",
                f"pod {pod}",
                f"Pending: not enough {resource} on any node ({message.strip()})",
                _insufficient_fix(resource, recipe),
            )
        )
    if "didn't match Pod's node affinity/selector" in message or "node(s) didn't match node selector" in message:
        amx = _get(recipe, "k8s.amx_label", None)
        profile = _get(recipe, "k8s.profile", "cpu")
        hint = (
            (
                f"; on the cpu profile the workers also require {amx}=true (Node Feature Discovery sets it on "
                "AMX Xeons): install NFD or set k8s.amx_label=null"
            )
            if amx and profile == "cpu"
            else ""
        )
        out.append(
            Finding(
                "error",
                f"pod {pod}",
                "Pending: no node matches the pod's node selector / affinity",
                f"check k8s.node_selector (now {_get(recipe, 'k8s.node_selector', {})}) against "
                f"`kubectl get nodes --show-labels`{hint}",
            )
        )
    for taint in dict.fromkeys(_TAINT.findall(message)):
        key = taint.split(":")[0].strip()
        out.append(
            Finding(
                "error",
                f"pod {pod}",
                f"Pending: the nodes carry the taint {{{taint}}}",
                f"tolerate it: k8s.tolerations='[{{key: {key}, operator: Exists}}]' (or schedule elsewhere)",
            )
        )
    if "unbound immediate PersistentVolumeClaims" in message:
        out.append(
            Finding(
                "error", f"pod {pod}", "Pending: its PersistentVolumeClaim is not bound", "see the PVC finding below"
            )
        )
    return out


def _storage_findings(snap: Snapshot, events: list[dict]) -> list[Finding]:
    pvc = snap.pvc
    if pvc is None or _get(pvc, "status.phase", "") != "Pending":
        return []
    name = pvc["metadata"]["name"]
    cls = _get(pvc, "spec.storageClassName", None)
    msgs = [e.get("message", "") for e in events if _involved(e) == ("PersistentVolumeClaim", name)]
    if snap.storage_class_missing:
        return [
            Finding(
                "error",
                f"pvc {name}",
                f"StorageClass {snap.storage_class_missing} does not exist",
                "set k8s.storage.storage_class to a class from `kubectl get storageclass` that offers "
                "ReadWriteMany (NFS, CephFS, Azure Files, EFS, Filestore...)",
            )
        ]
    text = " ".join(msgs)
    if "no storage class is set" in text or (cls is None and "no persistent volumes available" in text):
        return [
            Finding(
                "error",
                f"pvc {name}",
                "no StorageClass is set and no default class provisions the claim",
                "set k8s.storage.storage_class (an RWX class), or mark one default, or use k8s.storage.existing_claim",
            )
        ]
    if "access mode" in text.lower() or "ReadWriteMany" in text:
        return [
            Finding(
                "error",
                f"pvc {name}",
                f"StorageClass {cls} cannot provide ReadWriteMany ({text.strip()})",
                "use an RWX-capable class for k8s.storage.storage_class (block storage is ReadWriteOnce)",
            )
        ]
    detail = f" ({msgs[-1].strip()})" if msgs else ""
    return [
        Finding(
            "warning",
            f"pvc {name}",
            f"the claim is still Pending{detail}",
            "check the provisioner of StorageClass "
            f"{cls or '(default)'}: `kubectl describe pvc {name} -n {snap.namespace}`",
        )
    ]


# ----------------------------------------------------------------------------- containers

_RENDEZVOUS = re.compile(
    r"RendezvousTimeoutError|RendezvousConnectionError|rendezvous.{0,80}(timed out|timeout)|DistNetworkError|"
    r"TCPStore.{0,120}(timed out|Connection refused|failed)|client socket has timed out|"
    r"connect\(\) to .{0,80}(timed out|failed)|Name or service not known",
    re.IGNORECASE,
)
# What the Hub's client and transformers say when the Hub refuses the token (401: none or invalid,
# 403: not granted access; `X-Error-Code: GatedRepo`); kubetune's own error line keeps transformers'
# first line, "You are trying to access a gated repo."
_HUB_ACCESS = re.compile(
    r"GatedRepoError|gated repo|is a gated repository|\b40[13] Client Error|"
    r"Invalid credentials in Authorization header|Invalid user token",
    re.IGNORECASE,
)
_COLLECTIVE = re.compile(
    r"Watchdog caught collective operation timeout|collective operation timeout|"
    r"(NCCL|HCCL|Gloo|gloo).{0,120}(timed out|timeout|Timeout)|ProcessGroup\w*.{0,80}timed out",
    re.IGNORECASE,
)


def _container_findings(pod: dict, recipe: dict, lines: list[str], job: str, namespace: str) -> list[Finding]:
    name = pod["metadata"]["name"]
    out = []
    hub_refused = any(_HUB_ACCESS.search(line) for line in lines)
    for cs in _get(pod, "status.containerStatuses", []) or []:
        state, last = cs.get("state") or {}, cs.get("lastState") or {}
        waiting = (state.get("waiting") or {}).get("reason")
        terminated = [(s.get("terminated") or {}) for s in (state, last)]
        if waiting in ("ImagePullBackOff", "ErrImagePull", "InvalidImageName"):
            out.append(
                Finding(
                    "error",
                    f"pod {name}",
                    f"{waiting}: image {cs.get('image')} cannot be pulled "
                    f"({(state.get('waiting') or {}).get('message', '').strip()})",
                    "check k8s.image (name and tag exist, e.g. `docker manifest inspect IMAGE`), and for a "
                    "private registry add an imagePullSecret to the namespace's service account",
                )
            )
        if waiting == "CreateContainerConfigError":
            out.append(
                Finding(
                    "error",
                    f"pod {name}",
                    f"CreateContainerConfigError: {(state.get('waiting') or {}).get('message', '')}",
                    f"a ConfigMap or Secret it mounts is missing: run `kubetune k8s submit RECIPE -n {namespace}` "
                    "again",
                )
            )
        oom = any(t.get("reason") == "OOMKilled" for t in terminated)
        if oom:
            out.append(
                Finding(
                    "error",
                    f"pod {name}",
                    "OOMKilled: the training process reached the memory limit "
                    f"(k8s.resources.memory={_get(recipe, 'k8s.resources.memory')})",
                    _oom_fix(recipe),
                )
            )
        # OOM, or the Hub refusing the token (_hub_access_finding), already explains the crash loop
        if waiting == "CrashLoopBackOff" and not (oom or hub_refused):
            tail = " | ".join(line.strip() for line in lines[-3:] if line.strip()) or "no log lines"
            out.append(
                Finding(
                    "error",
                    f"pod {name}",
                    f"CrashLoopBackOff after {cs.get('restartCount', 0)} restarts; last log: {tail}",
                    f"read `kubetune k8s logs {job} -n {namespace} --rank N`; fix the cause, then submit "
                    "again (it resumes from the last checkpoint)",
                )
            )
    return out


def _hub_access_finding(pod: str, lines: list[str], recipe: dict, job: str, namespace: str) -> list[Finding]:
    """The Hub refused the pod's token: say whose token, where it lives, and how to replace it."""
    refused = next((line for line in lines if _HUB_ACCESS.search(line)), None)
    if refused is None:
        return []
    model = _get(recipe, "model.name_or_path", None)
    page = f"https://huggingface.co/{model}" if model else "the model's page on huggingface.co"
    secret = Names.for_job(job, namespace).secret
    return [
        Finding(
            "error",
            f"pod {pod}",
            f"the Hugging Face token is missing or has no access to {model or 'the model'} ({refused.strip()[:200]})",
            f"use a token whose account was granted access (request it at {page}) and put "
            f"it in Secret {secret}, which the pods read when they restart: `kubetune k8s submit RECIPE -n "
            f"{namespace} --hf-token-file FILE`, or for a FineTune `kubectl create secret generic {secret} -n "
            f"{namespace} --from-file={TOKEN_KEY}=FILE --dry-run=client -o yaml | kubectl apply -f -`",
        )
    ]


def _oom_fix(recipe: dict) -> str:
    """The levers against an OOMKill that the recipe has not pulled yet (never one it has), the
    batch-keeping ones first, then a shorter context; raising the limit always."""
    micro, checkpointing = _get(recipe, "train.micro_batch_size"), _get(recipe, "train.gradient_checkpointing")
    levers, pulled = [], []
    if isinstance(micro, int) and micro <= 1:
        pulled.append(f"train.micro_batch_size is {micro}")
    else:
        levers.append(f"lower train.micro_batch_size (now {micro}) and raise train.grad_accum to keep the batch")
    if checkpointing not in RECOMPUTES:
        levers.append(f"set train.gradient_checkpointing=on (now {checkpointing})")
    elif checkpointing in OFFLOADS and _get(recipe, "k8s.profile") != "cpu":
        # offloaded activations leave the accelerator for the pod's memory, which is what ran out
        levers.append(f"set train.gradient_checkpointing=on (now {checkpointing}: its offload fills the pod's memory)")
    else:
        pulled.append(f"train.gradient_checkpointing is {checkpointing}")
    if not levers:
        levers.append(f"lower data.max_seq_len (now {_get(recipe, 'data.max_seq_len')}; longer rows are truncated)")
    fix = ", ".join(levers) + f", or raise k8s.resources.memory (now {_get(recipe, 'k8s.resources.memory')})"
    return fix + (f" ({' and '.join(pulled)} already)" if pulled else "")


def _log_findings(pod: str, lines: list[str], recipe: dict) -> list[Finding]:
    out = []
    rdzv = next((line for line in lines if _RENDEZVOUS.search(line)), None)
    if rdzv:
        out.append(
            Finding(
                "error",
                f"pod {pod}",
                f"rendezvous failed: {rdzv.strip()[:200]}",
                "the workers cannot reach the master: check that every replica was scheduled (gang scheduling "
                "helps: k8s.gang=coscheduling|volcano), that NetworkPolicies allow pod-to-pod traffic on "
                "ports 23456/29500, and that comm.socket_ifname names the pod network interface",
            )
        )
    coll = next((line for line in lines if _COLLECTIVE.search(line)), None)
    if coll:
        out.append(
            Finding(
                "error",
                f"pod {pod}",
                f"collective timeout: {coll.strip()[:200]}",
                f"raise parallel.timeout_s (now {_get(recipe, 'parallel.timeout_s')}) if one rank is slow "
                "(e.g. first-time tokenization), check comm.socket_ifname / comm.nccl.socket_ifname, and "
                "set comm.nccl.debug=INFO (nvidia) to see which peer is missing",
            )
        )
    return out


def _oneccl_findings(snap: Snapshot) -> list[Finding]:
    """oneCCL / Intel MPI variables (a oneCCL habit: the troubleshooting of Intel's Xeon guide checks them) do
    nothing in a kubetune job: say what sets the same thing here."""
    names = set(_get(snap.recipe, "comm.extra_env", {}) or {})
    for pod in snap.pods:
        for container in _get(pod, "spec.containers", []) or []:
            names.update(e.get("name", "") for e in container.get("env") or [])
    found = oneccl_variables(sorted(names))
    if not found:
        return []
    kind = _get(snap.recipe, "k8s.profile", "cpu")
    problem = f"oneCCL / Intel MPI variables are set: {', '.join(found)}"
    return [
        Finding("warning", f"job {snap.name}", problem, oneccl_advice(kind if kind in ACCELERATOR_KINDS else "cpu"))
    ]


def _quota_fix(namespace: str) -> str:
    return (
        f"wait for the jobs holding it to finish (`kubetune k8s status NAME -n {namespace}`), make this one smaller "
        f"(k8s.replicas, k8s.resources.*), or raise the quota (`kubectl edit resourcequota NAME -n {namespace}`)"
    )


def _quota_findings(snap: Snapshot) -> list[Finding]:
    """Pods the job still lacks that the namespace's quotas have no room for."""
    job = snap.job
    if job is None or not snap.quotas:
        return []
    done = {c.get("type") for c in _get(job, "status.conditions", []) or [] if c.get("status") == "True"}
    if done & {"Succeeded", "Failed", "Complete"}:
        return []
    need = quota.missing(quota.job_usage(job), snap.pods)
    if need:
        lines = quota.shortfalls(snap.quotas, snap.namespace_pods, need, snap.name, ours=True)
        return [Finding("error", f"{job['kind']} {snap.name}", line, _quota_fix(snap.namespace)) for line in lines]
    return []


def _exceeded_quota_events(snap: Snapshot) -> list[Finding]:
    """The operator's own word: it could not create a pod because a quota is full."""
    found = [
        e.get("message", "")
        for e in snap.events
        if _involved(e)[1] == snap.name and "exceeded quota" in e.get("message", "")
    ]
    if not found:
        return []
    problem = f"pods cannot be created: {found[-1].strip()[:300]}"
    return [Finding("error", f"job {snap.name}", problem, _quota_fix(snap.namespace))]


# ----------------------------------------------------------------------------- Kueue

# What to do about a pending Workload, by what Kueue's QuotaReserved message says (first match).
_PENDING_FIXES = (
    (
        re.compile(r"LocalQueue \S+ (doesn't exist|is inactive)"),
        (
            "create or restart the LocalQueue: `kubetune k8s render RECIPE --kueue -o DIR` writes it with its "
            "ClusterQueue (`kubectl create -f` them), or set k8s.queue to one of `kubectl get localqueues -n {ns}`"
        ),
    ),
    (
        re.compile(r"ClusterQueue \S+ (doesn't exist|is inactive)"),
        (
            "the ClusterQueue behind LocalQueue {queue} is missing, stopped or lacks its ResourceFlavor or Topology: "
            "`kubectl describe clusterqueue` shows which (`render --kueue` writes all three)"
        ),
    ),
    (
        re.compile(r"request > maximum capacity|> maximum capacity"),
        (
            "the job asks for more than its ClusterQueue can ever lend it, so it never fits: raise that resource's "
            "nominalQuota (`kubectl edit clusterqueue`; k8s.kueue.quota_jobs with `render --kueue`) or lower "
            "k8s.replicas / k8s.resources.*"
        ),
    ),
    (
        re.compile(r"insufficient unused quota"),
        (
            "other Workloads hold the quota (`kubectl get workloads -n {ns}`): it is admitted when they finish; "
            "a higher k8s.priority_value lets it preempt them where the ClusterQueue allows preemption"
        ),
    ),
    (
        re.compile(r"unavailable in ClusterQueue|not covered", re.IGNORECASE),
        (
            "the ClusterQueue does not cover a resource the pods request: add it to coveredResources with a quota "
            "(`render --kueue` covers every resource the job requests)"
        ),
    ),
    (
        re.compile(r"topology|doesn't allow to fit", re.IGNORECASE),
        (
            "no domain of the requested topology level has room for every pod: ask for k8s.kueue.topology.preferred "
            "instead of required, a wider level, or fewer k8s.replicas"
        ),
    ),
)
_EVICTED_FIXES = {
    "Preempted": "a Workload of higher priority took its quota; Kueue requeues it: raise k8s.priority_value or the "
    "ClusterQueue's quota",
    "PodsReadyTimeout": "its pods were not all ready in time (Kueue's waitForPodsReady): see the pod findings "
    "(image pulls, scheduling); Kueue requeues it",
    "InactiveWorkload": "Kueue deactivated it (too many requeues, or spec.active=false): fix the cause, then "
    '`kubectl patch workload {wl} -n {ns} --type merge -p \'{{"spec":{{"active":true}}}}\'`',
    "ClusterQueueStopped": "its ClusterQueue was stopped (spec.stopPolicy): resume it with `kubectl edit clusterqueue`",
    "LocalQueueStopped": "LocalQueue {queue} was stopped (spec.stopPolicy): resume it with "
    "`kubectl edit localqueue {queue} -n {ns}`",
}


def _conditions(obj: dict) -> dict[str, dict]:
    return {c.get("type", ""): c for c in _get(obj, "status.conditions", []) or []}


def _said(condition: dict) -> str:
    return f"{condition.get('reason', '')}: {condition.get('message', '')}".strip(": ")


def _queue_findings(snap: Snapshot, queue: str) -> list[Finding]:
    """Why Kueue has not started a job that waits, suspended, in `queue`."""
    subject, ns = f"{(snap.job or {}).get('kind')} {snap.name}", snap.namespace
    if not snap.kueue_read:
        return [
            Finding(
                "warning",
                subject,
                f"suspended, waiting for admission in Kueue queue {queue} (its Workload could not be read)",
                f"the ClusterQueue behind LocalQueue {queue} lacks quota for the job, or the LocalQueue is missing: "
                f"`kubectl describe localqueue {queue} -n {ns}` and `kubectl get workloads -n {ns}`",
            )
        ]
    if snap.local_queue_missing:
        problem = f"suspended in Kueue queue {queue}, but LocalQueue {queue} does not exist in namespace {ns}"
        fix = _PENDING_FIXES[0][1].format(ns=ns, queue=queue)
        if snap.workload is None:  # no Workload either: Kueue's API may be missing altogether
            fix += "; is Kueue installed? (`kubectl get crd localqueues.kueue.x-k8s.io`)"
        return [Finding("error", subject, problem, fix)]
    if snap.workload is None:
        return [
            Finding(
                "warning",
                subject,
                f"suspended in Kueue queue {queue}, and Kueue made no Workload for it",
                f"Kueue is not running or does not manage this kind (`kubectl describe localqueue {queue} -n {ns}`, "
                "`kubectl get pods -n kueue-system`): its configuration's integrations.frameworks must list "
                "kubeflow.org/pytorchjob or trainer.kubeflow.org/trainjob; without Kueue, drop k8s.queue",
            )
        ]
    return _workload_findings(snap.workload, subject, queue, ns)


def _workload_findings(workload: dict, subject: str, queue: str, ns: str) -> list[Finding]:
    """One finding from the Workload's conditions: evicted, pending, or waiting for its checks or pods."""
    wl = workload["metadata"]["name"]
    conditions = _conditions(workload)
    holds = {kind for kind, c in conditions.items() if c.get("status") == "True"}
    subject = f"{subject} (Workload {wl})"
    if "Finished" in holds:
        return []
    if "Evicted" in holds:
        evicted = conditions["Evicted"]
        fix = _EVICTED_FIXES.get(evicted.get("reason", ""), f"`kubectl describe workload {wl} -n {ns}`")
        return [Finding("error", subject, f"evicted by Kueue: {_said(evicted)}", fix.format(wl=wl, ns=ns, queue=queue))]
    if "Admitted" in holds:
        ready = conditions.get("PodsReady")
        if ready is None or ready.get("status") == "True":
            return [Finding("info", subject, "admitted by Kueue; the job starts now", "wait a moment")]
        problem = f"admitted by Kueue, its pods not ready: {_said(ready)}"
        return [Finding("warning", subject, problem, "see the pod findings; `kubetune k8s status` once they run")]
    if "QuotaReserved" in holds:
        admitted = conditions.get("Admitted") or {}
        problem = f"quota reserved, waiting for its admission checks: {_said(admitted) or 'no Admitted condition yet'}"
        return [Finding("warning", subject, problem, f"`kubectl describe workload {wl} -n {ns}` (admissionChecks)")]
    pending = conditions.get("QuotaReserved")
    said = _said(pending) if pending else "no QuotaReserved condition yet (Kueue has not considered it)"
    message = (pending or {}).get("message", "")
    default = f"`kubectl describe workload {wl} -n {ns}` and `kubectl describe localqueue {queue} -n {ns}`"
    fix = next((f for pattern, f in _PENDING_FIXES if pattern.search(message)), default)
    return [Finding("error", subject, f"not admitted by Kueue: {said}", fix.format(ns=ns, queue=queue))]


# ----------------------------------------------------------------------------- job level


def _involved(event: dict) -> tuple[str | None, str | None]:
    obj = event.get("involvedObject") or event.get("regarding") or {}
    return obj.get("kind"), obj.get("name")


def _job_findings(snap: Snapshot) -> list[Finding]:
    job = snap.job
    if job is None:
        return [
            Finding(
                "error",
                f"job {snap.name}",
                f"no PyTorchJob or TrainJob {snap.name} in {snap.namespace}",
                "find its namespace with `kubectl get pytorchjobs,trainjobs -A` and pass it with -n, or "
                f"`kubetune k8s submit RECIPE -n {snap.namespace}` it",
            )
        ]
    out = []
    conditions = _get(job, "status.conditions", []) or []
    failed = [c for c in conditions if c.get("type") == "Failed" and c.get("status") == "True"]
    if failed:
        out.append(
            Finding(
                "error",
                f"{job['kind']} {snap.name}",
                f"Failed: {failed[-1].get('reason', '')} {failed[-1].get('message', '')}".strip(),
                f"see the pod findings; after fixing, `kubetune k8s delete {snap.name} -n {snap.namespace}` and "
                "submit again (checkpoints on the PVC are kept)",
            )
        )
    suspended = _get(job, "spec.suspend", False) is True or _get(job, "spec.runPolicy.suspend", False) is True
    queue = (job["metadata"].get("labels") or {}).get(KUEUE_LABEL)
    if not snap.pods and not failed:
        if suspended and queue:
            out += _queue_findings(snap, queue)
        elif suspended:
            out.append(Finding("warning", f"{job['kind']} {snap.name}", "the job is suspended", "unsuspend it"))
        elif not _get(job, "status", None):
            out.append(
                Finding(
                    "error",
                    f"{job['kind']} {snap.name}",
                    "no status and no pods: no controller handles it",
                    "install and start the Kubeflow training operator (PyTorchJob) or Trainer v2 (TrainJob): "
                    "`kubectl get pods -n kubeflow` / `-n kubeflow-system`",
                )
            )
    return out


def diagnose(snap: Snapshot) -> list[Finding]:
    """Every finding, errors first; one `info` finding when nothing looks wrong."""
    findings = _job_findings(snap)
    by_pod: dict[str, list[dict]] = {}
    for event in snap.events:
        kind, name = _involved(event)
        if kind == "Pod" and name and event.get("reason") == "FailedScheduling":
            by_pod.setdefault(name, []).append(event)
    for pod in snap.pods:
        name = pod["metadata"]["name"]
        if _get(pod, "status.phase", "") == "Pending":
            for event in by_pod.get(name, [])[-1:]:  # the newest scheduling verdict
                findings += _scheduling_findings(name, event.get("message", ""), snap.recipe)
        findings += _container_findings(pod, snap.recipe, snap.logs.get(name, []), snap.name, snap.namespace)
        findings += _log_findings(name, snap.logs.get(name, []), snap.recipe)
        findings += _hub_access_finding(name, snap.logs.get(name, []), snap.recipe, snap.name, snap.namespace)
    findings += _storage_findings(snap, snap.events)
    findings += _oneccl_findings(snap)
    findings += _quota_findings(snap) or _exceeded_quota_events(snap)
    if not findings:
        status = f"`kubetune k8s status {snap.name} -n {snap.namespace}`"
        findings.append(Finding("info", f"job {snap.name}", f"no problems found in namespace {snap.namespace}", status))
    return worst_first(findings)


# ----------------------------------------------------------------------------- collect


def collect(client, name: str, namespace: str, log_lines: int = 200) -> Snapshot:
    """Everything `diagnose` looks at, read through the client."""
    import yaml

    from kubetune.k8s.follow import JOB_KINDS, trainer_pods
    from kubetune.k8s.names import CONTAINER, RECIPE_KEY
    from kubetune.kubeapi import ClusterError

    job = next((j for av, kind, _ in JOB_KINDS if (j := client.get(av, kind, name, namespace)) is not None), None)
    names = Names.for_job(name, namespace)
    snap = Snapshot(name=name, namespace=namespace, job=job, pods=trainer_pods(client, name, namespace, job))
    snap.events = client.list("v1", "Event", namespace)
    with contextlib.suppress(ClusterError):  # no right to read quotas: diagnose without them
        snap.quotas = client.list("v1", "ResourceQuota", namespace)
        snap.namespace_pods = client.list("v1", "Pod", namespace) if snap.quotas else []
    cm = client.get("v1", "ConfigMap", names.recipe, namespace)
    try:
        snap.recipe = _with_resolved_resources(yaml.safe_load(cm["data"][RECIPE_KEY]) or {})
    except (TypeError, KeyError, yaml.YAMLError):
        snap.recipe = {}
    claim = _get(snap.recipe, "k8s.storage.existing_claim", None) or names.pvc
    snap.pvc = client.get("v1", "PersistentVolumeClaim", claim, namespace)
    cls = _get(snap.pvc or {}, "spec.storageClassName", None)
    if cls and client.get("storage.k8s.io/v1", "StorageClass", cls) is None:
        snap.storage_class_missing = cls
    if job is not None and (queue := kueue.queue_of(job)):
        _collect_queue(client, snap, job, queue)
    container = CONTAINER["pytorchjob" if (job or {}).get("kind") != "TrainJob" else "trainjob"]
    for pod in snap.pods:
        if _get(pod, "status.phase", "") == "Pending" and not _get(pod, "status.containerStatuses", None):
            continue  # never started: no log to read
        with contextlib.suppress(ClusterError):  # no log yet, or no permission: diagnose without it
            snap.logs[pod["metadata"]["name"]] = list(
                client.pod_log(pod["metadata"]["name"], namespace, container, tail_lines=log_lines)
            )
    return snap


def _collect_queue(client, snap: Snapshot, job: dict, queue: str) -> None:
    """The job's Kueue Workload and whether its LocalQueue exists (nothing when Kueue's API is not readable)."""
    from kubetune.kubeapi import ClusterError

    with contextlib.suppress(ClusterError):
        snap.workload = kueue.workload_of(client.list(kueue.API_VERSION, "Workload", snap.namespace), job)
        snap.local_queue_missing = client.get(kueue.API_VERSION, "LocalQueue", queue, snap.namespace) is None
        snap.kueue_read = True


def _with_resolved_resources(recipe: dict) -> dict:
    """Fill the profile defaults into k8s.resources, so fixes quote the values the pods got."""
    from pydantic import ValidationError

    from kubetune.recipe.schema import Recipe

    try:
        resources = Recipe.model_validate(recipe).k8s.worker_resources()
    except ValidationError:  # a recipe from another kubetune version: quote it as it is
        return recipe
    recipe.setdefault("k8s", {})["resources"] = resources
    return recipe


def report(findings: list[Finding]) -> list[str]:
    lines = []
    for f in findings:
        lines.append(f"[{f.severity}] {f.subject}: {f.problem}")
        lines.append(f"    fix: {f.fix}")
    return lines
