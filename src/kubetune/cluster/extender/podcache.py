"""Optional watch-backed cache of pods and node labels (`--watch-pods`).

Stateless, the extender knows only what the Node objects say. With this cache it also knows
(a) how many cards the pods bound to each node hold, which is fresher than the plugin's
`cards-free` annotation, and (b) where the other workers of a training job run, which the
`closeness` score needs. The state is a plain dict updated by `apply(event, object)`; the
watch threads (kubernetes client, imported lazily) only feed it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass

from kubetune.cluster.extender.facts import JOB_LABELS, pod_cards
from kubetune.cluster.extender.protocol import Pod

log = logging.getLogger(__name__)

_DONE_PHASES = ("Succeeded", "Failed")


@dataclass(frozen=True)
class _PodEntry:
    node: str
    namespace: str
    job: str | None
    cards: dict[str, int]


class PodCache:
    """Pods that hold a node (bound, not finished) and the leaf label of every node."""

    def __init__(self, resources: tuple[str, ...], leaf_labels: tuple[str, ...]):
        self.resources = resources
        self.leaf_labels = leaf_labels
        self._pods: dict[str, _PodEntry] = {}
        self._leaf: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.synced = threading.Event()

    # -- state -------------------------------------------------------------------------
    def apply_pod(self, event: str, obj: dict) -> None:
        """`event` ADDED | MODIFIED | DELETED; `obj` a v1.Pod as JSON (dict)."""
        pod = Pod.model_validate(obj)
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        phase = (obj.get("status") or {}).get("phase")
        with self._lock:
            if event == "DELETED" or not pod.spec.node_name or phase in _DONE_PHASES:
                self._pods.pop(key, None)
                return
            labels = pod.metadata.labels or {}
            job = next((labels[k] for k in JOB_LABELS if labels.get(k)), None)
            cards = {r: n for r in self.resources if (n := pod_cards(pod, r)) > 0}
            self._pods[key] = _PodEntry(pod.spec.node_name, pod.metadata.namespace or "default", job, cards)

    def apply_node(self, event: str, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        name, labels = meta.get("name", ""), meta.get("labels") or {}
        with self._lock:
            leaf = next((labels[k] for k in self.leaf_labels if labels.get(k)), None)
            if event == "DELETED" or leaf is None:
                self._leaf.pop(name, None)
            else:
                self._leaf[name] = leaf

    # -- PodView -----------------------------------------------------------------------
    def used_cards(self, node: str, resource: str) -> int | None:
        if not self.synced.is_set():
            return None  # before the first list, "unknown" is the honest answer
        with self._lock:
            return sum(p.cards.get(resource, 0) for p in self._pods.values() if p.node == node)

    def peers(self, namespace: str, job: str) -> Counter[str]:
        with self._lock:
            return Counter(p.node for p in self._pods.values() if p.job == job and p.namespace == namespace)

    def leaf_of(self, node: str) -> str | None:
        with self._lock:
            return self._leaf.get(node)

    def replace(self, kind: str, items: list[dict]) -> None:
        """A fresh LIST: forget what we had of that kind (deletions missed while away)."""
        with self._lock:
            if kind == "pods":
                self._pods.clear()
            else:
                self._leaf.clear()
        apply = self.apply_pod if kind == "pods" else self.apply_node
        for item in items:
            apply("ADDED", item)
        if kind == "pods":
            self.synced.set()

    # -- watching (kubernetes client) ----------------------------------------------------
    def start(self, core_api=None, relist_seconds: float = 2.0) -> None:
        """List, then watch pods and nodes in two daemon threads (relisting after any failure)."""
        if core_api is None:
            from kubetune.kube import core_v1_api

            core_api = core_v1_api()
        for kind, lister in (("pods", core_api.list_pod_for_all_namespaces), ("nodes", core_api.list_node)):
            threading.Thread(
                target=self._watch,
                args=(kind, lister, core_api.api_client, relist_seconds),
                name=f"watch-{kind}",
                daemon=True,
            ).start()

    def _watch(self, kind, lister, api_client, relist_seconds: float) -> None:
        import json

        from kubernetes import watch

        apply = self.apply_pod if kind == "pods" else self.apply_node
        while not self._stop.is_set():
            try:
                body = json.loads(lister(_preload_content=False).data)
                self.replace(kind, body.get("items") or [])
                version = (body.get("metadata") or {}).get("resourceVersion")
                w = watch.Watch()
                for event in w.stream(lister, resource_version=version, timeout_seconds=300):
                    apply(event["type"], api_client.sanitize_for_serialization(event["object"]))
                    if self._stop.is_set():
                        w.stop()
                        break
            except Exception as e:  # the API server went away or the watch expired: list again
                log.warning("watch of %s failed (%s); relisting in %.0f s", kind, e, relist_seconds)
            self._stop.wait(relist_seconds)

    def stop(self) -> None:
        self._stop.set()
