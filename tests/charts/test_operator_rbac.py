"""The operator's RBAC in the chart is exactly what the operator calls: nothing missing, nothing spare.

The operator talks to the API server through two doors: kopf (the FineTune watch, its finalizer and annotation
patches, status patches, events) and kubetune's KubeClient (everything else). The KubeClient side is recorded:
kopf's handlers run through whole lifecycles over tests/k8s/fakes.FakeClient, and every call is written down as
the RBAC request the API server would authorise (API group, resource or subresource, verb). kopf's side is
listed below from kopf's code. The chart's rules must grant that set and no more, namespaced requests in the
role bound to the FineTune namespaces and cluster-scoped ones in the cluster role.
"""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest

from kubetune.k8s.names import trainer_selector
from kubetune.kubeapi import Conflict, kind_of

from ..k8s.fakes import FakeClient
from .helm import OPERATOR_CHART, objects

# The chart's role names for the release `kt` (helm.render's): the operator's rules, and kopf's cluster-wide ones
OPERATOR_ROLE = "kt-kubetune-operator"
CLUSTER_ROLE = "kt-kubetune-operator-cluster"

kopf = pytest.importorskip("kopf")
handlers = pytest.importorskip("kubetune.operator.handlers")
modelserver = pytest.importorskip("kubetune.operator.modelserver")
replicas = pytest.importorskip("kubetune.operator.replicas")

Request = tuple[str, str, str]  # (API group, resource[/subresource], verb)

# What kopf itself asks for (kopf 1.45, standalone: no peering objects).
KOPF_NAMESPACED: set[Request] = {
    ("kubetune.io", "finetunes", "list"),  # the initial listing of the watch
    ("kubetune.io", "finetunes", "watch"),
    ("kubetune.io", "finetunes", "patch"),  # the finalizer, handler progress and diff-base annotations
    ("kubetune.io", "finetunes/status", "patch"),  # status is a subresource: kopf patches it there
    ("kubetune.io", "modelservers", "list"),  # the same for ModelServers
    ("kubetune.io", "modelservers", "watch"),
    ("kubetune.io", "modelservers", "patch"),
    ("kubetune.io", "modelservers/status", "patch"),
    ("", "events", "create"),  # kopf posts an Event per handler outcome (core v1 events)
}
KOPF_CLUSTER: set[Request] = {
    # kopf's resource observer lists and watches CRDs to see resources appear (without: a warning, and it only
    # notices the FineTune CRD at a restart)
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
}
# What the API server asks for what the operator does, beyond the call itself: an owner reference with
# blockOwnerDeletion needs `update` on the owner's finalizers (the OwnerReferencesPermissionEnforcement
# admission plugin, on in OpenShift and many hardened clusters).
ADMISSION: set[Request] = {
    ("kubetune.io", "finetunes/finalizers", "update"),
    ("kubetune.io", "modelservers/finalizers", "update"),
}

NAMESPACE = "team-a"
TOKEN = "hf_TESTtoken0123456789abcdefghijklmnopq"


class RecordingClient(FakeClient):
    """FakeClient that writes each call down as the request the API server authorises. Logs and execs answer
    empty (the operator then falls back to its next source), never fail: this test is about who asks what."""

    def __init__(self, objs=()):
        super().__init__(objs)
        self.requests: dict[bool, set[Request]] = {True: set(), False: set()}  # namespaced? -> requests

    def _ask(self, api_version: str, kind: str, verb: str, sub: str = "") -> None:
        k = kind_of(api_version, kind)
        group = api_version.rpartition("/")[0]
        self.requests[k.namespaced].add((group, k.plural + (f"/{sub}" if sub else ""), verb))

    def get(self, api_version, kind, name, namespace=None):
        self._ask(api_version, kind, "get")
        return super().get(api_version, kind, name, namespace)

    def list(self, api_version, kind, namespace=None, labels=None):
        self._ask(api_version, kind, "list")
        return super().list(api_version, kind, namespace, labels)

    def create(self, obj):
        self._ask(obj["apiVersion"], obj["kind"], "create")
        meta = obj["metadata"]
        if self._key(obj["apiVersion"], obj["kind"], meta["name"], meta.get("namespace")) in self.objects:
            raise Conflict(f"create {obj['kind']} {meta['name']}: exists")  # as the API server answers
        return super().create(obj)

    def patch(self, obj):
        self._ask(obj["apiVersion"], obj["kind"], "patch")
        return super().patch(obj)

    def patch_status(self, api_version, kind, name, namespace, status):
        self._ask(api_version, kind, "patch", "status")
        obj = self.objects[self._key(api_version, kind, name, namespace)]
        obj["status"] = {**(obj.get("status") or {}), **status}
        return obj

    def delete(self, api_version, kind, name, namespace=None):
        self._ask(api_version, kind, "delete")
        return super().delete(api_version, kind, name, namespace)

    def pod_log(self, pod, namespace, container=None, tail_lines=None, follow=False):
        self._ask("v1", "Pod", "get", "log")
        return iter(())

    def exec_to(self, pod, namespace, command, sink, container=None):
        self._ask("v1", "Pod", "create", "exec")  # exec over a websocket is authorised as create (Kubernetes 1.30+)
        return ""

    def job(self, ft: dict) -> dict:
        name = ft["metadata"]["name"]
        jobs = [o for (_, kind, ns, n), o in self.objects.items() if kind in ("PyTorchJob", "TrainJob")]
        (job,) = [o for o in jobs if (o["metadata"]["namespace"], o["metadata"]["name"]) == (NAMESPACE, name)]
        return job

    def set_condition(self, job: dict, condition: str) -> None:
        """What the Training Operator (or Trainer) writes on the job."""
        when = "2025-01-01T00:00:00Z"  # long ago: ttlSecondsAfterFinished has run out
        status = {"conditions": [{"type": condition, "status": "True", "lastTransitionTime": when}]}
        self.objects[self._key(job["apiVersion"], job["kind"], job["metadata"]["name"], NAMESPACE)]["status"] = status


def finetune(name: str, spec: dict) -> dict:
    return {
        "apiVersion": "kubetune.io/v1alpha1",
        "kind": "FineTune",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}", "generation": 1},
        "spec": spec,
    }


class Operator:
    """kopf's side of a handler call: the body it passes, the patch it applies afterwards."""

    def __init__(self, client: RecordingClient):
        self.memo = kopf.Memo(client=client)
        self.client = client

    def call(self, handler, ft: dict, **kw: Any) -> None:
        self.client._put(ft)  # the API server holds the FineTune too: the operator reads it back
        patch = kopf.Patch()
        try:
            handler(body=copy.deepcopy(ft), patch=patch, memo=self.memo, **kw)
        except (kopf.TemporaryError, kopf.PermanentError) as e:
            raise AssertionError(f"{handler.__name__}: {e}") from None
        ft.setdefault("status", {}).update(patch.get("status") or {})  # a merge patch: lists are replaced whole
        self.client._put(ft)

    def tick(self, ft: dict) -> None:
        self.call(handlers._follow, ft)


def trainer_pod(ft: dict, job: dict) -> dict:
    """Rank 0, running, restarted once (the operator then asks the doctor why)."""
    name = ft["metadata"]["name"]
    labels = {**trainer_selector(name), "training.kubeflow.org/replica-type": "master"}
    if job["kind"] == "TrainJob":
        labels = {**trainer_selector(name), "batch.kubernetes.io/job-completion-index": "0"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{name}-master-0", "namespace": NAMESPACE, "labels": labels},
        "spec": {"containers": [{"name": "pytorch"}]},
        "status": {"phase": "Running", "containerStatuses": [{"name": "pytorch", "restartCount": 1}]},
    }


def lifecycle(client: RecordingClient, ft: dict, edit: dict | None = None) -> None:
    """create (suspended -> resumed) -> running (a restart) -> succeeded -> export -> serving -> recipe edit ->
    suspend."""
    op = Operator(client)
    op.call(handlers._created, ft)
    if ft["spec"].get("suspend"):  # created suspended: nothing runs until it is resumed
        assert ft["status"]["phase"] == "Suspended", ft["status"]
        old = copy.deepcopy(ft["spec"])
        ft["spec"]["suspend"] = False
        op.call(handlers._spec_changed, ft, old=old, new=ft["spec"])  # acts now; the timer writes the status
        op.tick(ft)
    assert ft["status"]["phase"] == "Pending", ft["status"]
    job = client.job(ft)
    client._put(trainer_pod(ft, job))
    client.set_condition(job, "Running")
    op.tick(ft)
    assert ft["status"]["phase"] == "Running", ft["status"]
    client.set_condition(job, "Succeeded")
    op.tick(ft)  # -> the export Job
    spec, name = ft["spec"], ft["metadata"]["name"]
    if spec.get("serve", {}).get("enabled") or spec.get("export", {}).get("merged"):
        assert ft["status"]["phase"] == "Exporting", ft["status"]
        export = client.objects[client._key("batch/v1", "Job", name + "-export", NAMESPACE)]
        export["status"] = {"succeeded": 1}  # what the Job controller writes
        op.tick(ft)  # -> the serving objects
    want = "Serving" if spec.get("serve", {}).get("enabled") else "Succeeded"
    assert ft["status"]["phase"] == want, ft["status"]
    if edit is not None:  # a resumable recipe edit: applied to the job's ConfigMap
        old = copy.deepcopy(ft["spec"])
        ft["spec"]["recipe"] = {**ft["spec"]["recipe"], **edit}
        ft["metadata"]["generation"] += 1
        op.call(handlers._spec_changed, ft, old=old, new=ft["spec"])
    ft["spec"]["suspend"] = True
    op.tick(ft)


def server_lifecycle(client: RecordingClient) -> None:
    """A ModelServer created and followed; a FineTune of spec.serve.server trained, its adapter exported,
    registered and loaded on the server's replica, then deleted (unloaded, unregistered)."""
    from kubetune.k8s.names import server_selector

    op = Operator(client)
    ms = {
        "apiVersion": "kubetune.io/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": "shared", "namespace": NAMESPACE, "uid": "uid-shared", "generation": 1},
        "spec": {"base": {"model": "smollm2-135m-instruct"}, "autoscaling": {"metric": "queue"}},
    }
    op.call(modelserver._created, ms)
    ft = finetune("fifth", {"recipe": copy.deepcopy(SEED_LIKE), "serve": {"server": "shared"}})
    op.call(handlers._created, ft)
    job = client.job(ft)
    client.set_condition(job, "Succeeded")
    op.tick(ft)
    assert ft["status"]["phase"] == "Exporting", ft["status"]
    export = client.objects[client._key("batch/v1", "Job", "fifth-adapter-export", NAMESPACE)]
    export["status"] = {"succeeded": 1}
    op.tick(ft)
    assert ft["status"]["phase"] == "Serving", ft["status"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "shared-0", "namespace": NAMESPACE,
           "labels": server_selector("shared")}, "status": {"phase": "Running", "podIP": "10.0.0.9"}}  # fmt: skip
    client._put(pod)
    op.call(modelserver._make_follow(1.0), ms)
    assert ms["status"]["adapterCount"] == 1, ms["status"]
    op.call(handlers._deleted, ft)
    ft["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"  # held by kopf's finalizer until then
    client._put(ft)
    op.call(modelserver._make_follow(1.0), ms)  # its InferenceObjective goes
    assert ms["status"]["adapterCount"] == 0, ms["status"]


SEED_LIKE = {
    "model": {"name_or_path": "smollm2-135m-instruct"},
    "train": {"max_steps": 20},
    "k8s": {"replicas": 2, "resources": {"cpu": 4, "memory": "8Gi"}, "amx_label": None},
}


def scenarios(client: RecordingClient) -> None:
    # 1. PyTorchJob, coscheduling gang, the namespace's shared quota, a token, export and serving with an Ingress
    recipe = copy.deepcopy(SEED_LIKE)
    recipe["k8s"].update(gang="coscheduling", namespace_quota={"cpu": 64}, storage={"storage_class": "nfs-client"})
    spec = {
        "recipe": recipe,
        "profile": "cpu",
        "api": "pytorchjob",
        "hfTokenSecretRef": {"name": "hf-token"},
        "serve": {"enabled": True, "ingressHost": "llm.example.com"},
        "ttlSecondsAfterFinished": 0,
    }
    lifecycle(client, finetune("first", spec), edit={"train": {"max_steps": 40}})
    # 2. from a ConfigMap, Volcano's gang, a quota of its own, a PriorityClass, the claim deleted with it, export only
    client._put(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "recipes", "namespace": NAMESPACE},
            "data": {
                "recipe.yaml": "model: {name_or_path: smollm2-135m-instruct}\nk8s: {gang: volcano, "
                "quota: true, amx_label: null, priority_class: kubetune-high, priority_value: 1000}\n"
            },
        }
    )
    spec = {"recipeRef": {"name": "recipes"}, "export": {"merged": True}, "volumeClaimRetention": "Delete"}
    lifecycle(client, finetune("second", spec))
    # 3. TrainJob, created suspended, then resumed
    lifecycle(client, finetune("third", {"recipe": copy.deepcopy(SEED_LIKE), "api": "trainjob", "suspend": True}))
    # 4. NVIDIA cards claimed through DRA (k8s.devices=dra): the pods' ResourceClaimTemplate
    recipe = copy.deepcopy(SEED_LIKE)
    recipe["k8s"].update(devices="dra", dra={"min_memory": "40Gi"})
    recipe["k8s"]["resources"].update(accelerators=1, shm_size="1Gi")
    lifecycle(client, finetune("fourth", {"recipe": recipe, "profile": "nvidia"}))
    # 5. a shared ModelServer, and a FineTune whose adapter it serves
    server_lifecycle(client)


@pytest.fixture(scope="module")
def recorded(monkeypatch_module) -> dict[bool, set[Request]]:
    from kubetune.operator import metrics_page

    # rank 0's metrics endpoint is plain HTTP to the pod (no RBAC): the pods here serve none
    monkeypatch_module.setattr(metrics_page, "fetch_metrics", lambda url: None)
    # the replicas' adapter routes are plain HTTP to the pods (no RBAC): every call works, nothing is loaded yet
    monkeypatch_module.setattr(replicas, "loaded_adapters", lambda replica: set())
    monkeypatch_module.setattr(replicas, "load", lambda replica, name, path: None)
    monkeypatch_module.setattr(replicas, "unload", lambda replica, name: None)
    monkeypatch_module.setattr(replicas, "set_alias", lambda replica, alias, weights: None)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token", "namespace": NAMESPACE},
              "data": {"HF_TOKEN": base64.b64encode(TOKEN.encode()).decode()}}  # fmt: skip
    client = RecordingClient([secret])
    scenarios(client)
    return client.requests


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def granted(role_name: str, values: dict | None = None) -> set[Request]:
    (role,) = [o for o in objects(OPERATOR_CHART, values) if o["kind"] == "ClusterRole" and
               o["metadata"]["name"] == role_name]  # fmt: skip
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_the_operator_role_grants_exactly_what_the_operator_asks_in_its_namespaces(recorded):
    needed = recorded[True] | KOPF_NAMESPACED | ADMISSION
    have = granted(OPERATOR_ROLE)
    assert sorted(needed - have) == [], "missing"
    assert sorted(have - needed) == [], "granted but never asked for"


# A recipe's k8s.priority_value makes the operator create a PriorityClass: a cluster-wide object that lets pods
# preempt others, so the chart grants it only when asked (operator.rbac.createPriorityClasses).
PRIORITY_CLASSES: set[Request] = {("scheduling.k8s.io", "priorityclasses", "create")}


@pytest.mark.parametrize("priority_classes", [False, True])
def test_the_cluster_role_grants_exactly_what_the_operator_asks_across_the_cluster(recorded, priority_classes):
    needed = recorded[False] | KOPF_CLUSTER
    assert needed >= PRIORITY_CLASSES  # the scenarios asked for it (scenario 2)
    if not priority_classes:
        needed -= PRIORITY_CLASSES
    have = granted(CLUSTER_ROLE, {"operator": {"rbac": {"createPriorityClasses": priority_classes}}})
    assert sorted(needed - have) == [], "missing"
    assert sorted(have - needed) == [], "granted but never asked for"


def test_the_scenarios_reach_every_kind_the_operator_renders(recorded):
    # guards the scenarios themselves: each optional object kind was created at least once
    created = {resource for group, resource, verb in recorded[True] if verb == "create"}
    kinds = {"pytorchjobs", "trainjobs", "podgroups", "resourcequotas", "secrets", "jobs", "ingresses"}
    assert kinds | {"resourceclaimtemplates"} <= created
