"""The operator against kmock's Kubernetes emulation over loopback HTTP, run by kopf.testing.KopfRunner.

The API server is tests/k8s/conftest.py's `kube` fixture (kmock.KubernetesEmulator behind a
real HTTP server; kubetune and kopf reach it through $KUBECONFIG), with the FineTune resource
(and its status subresource) and batch/v1 Jobs declared. What kmock does not do, and how
these tests stand in for it:

- uid, generation, resourceVersion: kmock assigns none. A reaction on creating a FineTune
  gives it a uid and a resourceVersion (owner references name the uid; kopf's JSON patches
  test the resourceVersion before adding its finalizer, and kmock never changes it, so the
  test holds); `apply_finetune` writes generation 1 and `edit_spec` bumps it, as the API
  server does.
- garbage collection: kmock keeps an object whose owner is gone. `collect_garbage` deletes,
  over HTTP, every object whose owner references name no live object: what
  kube-controller-manager's garbage collector does after a FineTune is deleted.
- the Kubeflow training operator and the kubelet: nothing runs the PyTorchJob here. The
  tests write the job's status conditions over HTTP as the training operator would, create
  its rank-0 pod, and script that pod's log (kmock does not emulate logs) with the progress
  line the engine prints (`kubetune.contracts.progress_line.format_line`).
- CRD schema validation and pruning: kmock stores any object; tests/operator/test_crd.py
  checks the schema the API server would apply.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kubetune.operator.crd import API_VERSION, KIND
from tests.k8s.conftest import Kube
from tests.k8s.conftest import kube as kube  # the in-memory API server fixture, shared with tests/k8s

NAMESPACE = "kubetune"
VERBS = ["get", "list", "watch", "create", "patch", "delete"]  # kopf serves only what it may watch and patch
INTERVAL = 0.25  # the operator's timer: how often it looks at each FineTune's job


def wait_for(what: Callable[[], Any], timeout: float = 15.0, message: str = "") -> Any:
    """Poll `what` until it returns something truthy (the operator works in its own thread)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {message or what}")


class Cluster:
    """The test's hands on the API: as kubectl, the training operator and the garbage collector."""

    def __init__(self, kube: Kube):
        self.kube = kube
        self.client = kube.client()
        self._uid = 0
        self._logs: dict[str, str] = {}

    def set_log(self, pod: str, text: str) -> None:
        """What `kubectl logs POD` answers from now on (kmock serves no logs: a scripted reaction
        that reads this dict, so that a later log replaces an earlier one)."""
        import kmock

        if pod not in self._logs:
            route = ["get", kmock.resource("v1", "pods"), kmock.name(pod), kmock.subresource("log")]
            self.kube.emulator[tuple(route)] << (lambda: self._logs[pod].encode())
        self._logs[pod] = text

    def apply_finetune(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        self._uid += 1
        uid = f"uid-{name}-{self._uid}"
        meta = {"name": name, "namespace": NAMESPACE, "uid": uid, "generation": 1, "resourceVersion": "1"}
        return self.client.create({"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec})

    def finetune(self, name: str) -> dict[str, Any] | None:
        return self.client.get(API_VERSION, KIND, name, NAMESPACE)

    def status(self, name: str) -> dict[str, Any]:
        return (self.finetune(name) or {}).get("status") or {}

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        return next((c for c in self.status(name).get("conditions") or [] if c["type"] == kind), None)

    def edit_spec(self, name: str, spec: dict[str, Any]) -> None:
        live = self.finetune(name)
        assert live is not None
        generation = live["metadata"].get("generation", 1) + 1
        meta = {"name": name, "namespace": NAMESPACE, "generation": generation}
        self.client.patch({"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec})

    def settled(self) -> bool:
        """Every FineTune has been handled: refused, or its timer has written status once."""
        done = ("Training", "Valid:False")
        return all(
            any(c["type"] in done or f"{c['type']}:{c['status']}" in done for c in ft["status"]["conditions"])
            for ft in self.client.list(API_VERSION, KIND, NAMESPACE)
            if ft.get("status", {}).get("conditions")
        )

    def get(self, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        return self.client.get(api_version, kind, name, NAMESPACE)

    def set_status(self, api_version: str, kind: str, name: str, status: dict[str, Any]) -> None:
        self.client.patch_status(api_version, kind, name, NAMESPACE, status)

    def live_objects(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        for (resource, ns, name), obj in list(self.kube.emulator.objects.items()):
            if not obj.deleted and ns == NAMESPACE:
                group = resource.group + "/" if resource.group else ""
                yield f"{group}{resource.version}/{resource.plural}", name, obj.raw

    def owned_by(self, uid: str) -> list[str]:
        return sorted(
            f"{obj['kind']}/{name}"
            for _, name, obj in self.live_objects()
            if any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])
        )

    def collect_garbage(self) -> list[str]:
        """Delete what kube-controller-manager's garbage collector would: objects whose owners are gone."""
        live_uids = {obj.get("metadata", {}).get("uid") for _, _, obj in self.live_objects()}
        deleted = []
        for _, name, obj in list(self.live_objects()):
            refs = obj.get("metadata", {}).get("ownerReferences") or []
            if refs and not any(ref.get("uid") in live_uids for ref in refs):
                self.client.delete(obj["apiVersion"], obj["kind"], name, NAMESPACE)
                deleted.append(f"{obj['kind']}/{name}")
        return sorted(deleted)


@pytest.fixture
def cluster(kube: Kube) -> Cluster:
    import kmock

    kube.emulator.resources[f"{API_VERSION}/finetunes"] = kmock.ResourceInfo(
        kind=KIND, namespaced=True, subresources=["status"], verbs=VERBS
    )
    kube.emulator.resources["batch/v1/jobs"] = kmock.ResourceInfo(kind="Job", namespaced=True)
    # the shared servers: kopf watches them too; a ModelServer's gateway objects
    kube.emulator.resources[f"{API_VERSION}/modelservers"] = kmock.ResourceInfo(
        kind="ModelServer", namespaced=True, subresources=["status"], verbs=VERBS
    )
    for plural, kind in (
        ("inference.networking.k8s.io/v1/inferencepools", "InferencePool"),
        ("inference.networking.x-k8s.io/v1alpha2/inferenceobjectives", "InferenceObjective"),
    ):
        kube.emulator.resources[plural] = kmock.ResourceInfo(kind=kind, namespaced=True)
    finetunes = kmock.resource(*API_VERSION.split("/"), "finetunes")

    def assign_uid(request: Any) -> dict[str, Any]:
        """What the API server does on create and kmock does not: give the object a uid."""
        meta = request.data["metadata"]
        stored = kube.emulator.objects[finetunes, request.namespace or meta.get("namespace"), meta["name"]]
        if not stored.get("metadata", {}).get("uid"):
            stored.patch({"metadata": {"uid": f"uid-{meta['name']}", "resourceVersion": "1"}})
        return dict(stored.raw)

    kube.emulator["post", finetunes] << assign_uid
    # kopf looks namespaces up in discovery before it watches a namespace (it lists none: scanning is off)
    kube.emulator.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=VERBS)
    return Cluster(kube)


@pytest.fixture
def operator(cluster: Cluster) -> Iterator[Cluster]:
    """The operator (kopf) running against the emulated API in its own thread, for one test."""
    with running_operator(cluster):
        yield cluster


@contextlib.contextmanager
def running_operator(cluster: Cluster) -> Iterator[Cluster]:
    """The operator for the length of a `with` (a test that restarts it uses two)."""
    import kopf
    from kopf.testing import KopfRunner

    from kubetune.operator.handlers import register

    registry = kopf.OperatorRegistry()
    register(registry, interval=INTERVAL)
    settings = kopf.OperatorSettings()
    # kmock never changes resourceVersion: kopf would wait this long for its own patches to show
    # (5 s) after each one, and again at exit
    settings.persistence.consistency_timeout = 0.1
    settings.queueing.exit_timeout = 0.1
    settings.queueing.idle_timeout = 0.1
    settings.background.instant_exit_timeout = 0.1
    args = ["run", "--standalone", "--namespace", NAMESPACE]
    with KopfRunner(args, registry=registry, settings=settings, timeout=30) as runner:
        yield cluster
        # stop once the handlers have run: a timer kopf spawns while stopping hangs its exit for 5 s
        wait_for(cluster.settled, timeout=5, message="every FineTune handled once")
    assert runner.exit_code == 0, runner.output
