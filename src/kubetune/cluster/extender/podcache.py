"""Optional watch-backed cache of pods and nodes (`--watch-pods`).

Stateless, the extender knows only what the Node objects in the scheduler's request say. With
this cache it also knows (a) how many cards the pods bound to each node hold, which is fresher
than the plugin's `cards-free` annotation, (b) where the other workers of a training job run,
which the `closeness` score needs, and (c) every node's facts, so that the scheduler can send
node names only (`nodeCacheCapable: true`). The state is plain dicts updated by
`apply_pod` / `apply_node`; the watch threads (`KubeClient.watch`) only feed it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from contextlib import closing
from dataclasses import dataclass

from pydantic import ValidationError

from kubetune.cluster.extender.facts import JOB_LABELS, RawNode, pod_cards, raw_node
from kubetune.cluster.extender.protocol import Node, Pod
from kubetune.kubeapi import KubeClient, Listed

log = logging.getLogger(__name__)

_DONE_PHASES = ("Succeeded", "Failed")
_KINDS = {"pods": "Pod", "nodes": "Node"}  # what `replace` is told -> the kind watched


@dataclass(frozen=True)
class _PodEntry:
    node: str
    namespace: str
    job: str | None
    cards: dict[str, int]


class PodCache:
    """Pods that hold a node (bound, not finished), and what the policy reads of every node."""

    def __init__(self, resources: tuple[str, ...], leaf_labels: tuple[str, ...]):
        self.resources = resources
        self.leaf_labels = leaf_labels
        self._pods: dict[str, _PodEntry] = {}
        self._nodes: dict[str, RawNode] = {}
        self._used: dict[tuple[str, str], int] | None = {}  # (node, resource) -> cards; None: to recount
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.synced = threading.Event()

    # -- state -------------------------------------------------------------------------
    def _pod_entry(self, event: str, obj: dict) -> tuple[str, _PodEntry | None]:
        """-> (namespace/name, the entry; None when the pod holds no node: unbound, finished, deleted)."""
        pod = Pod.model_validate(obj)
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        phase = (obj.get("status") or {}).get("phase")
        if event == "DELETED" or not pod.spec.node_name or phase in _DONE_PHASES:
            return key, None
        labels = pod.metadata.labels or {}
        job = next((labels[k] for k in JOB_LABELS if labels.get(k)), None)
        cards = {r: n for r in self.resources if (n := pod_cards(pod, r)) > 0}
        return key, _PodEntry(pod.spec.node_name, pod.metadata.namespace or "default", job, cards)

    def _node_entry(self, event: str, obj: dict) -> tuple[str, RawNode | None]:
        """-> (name, what the policy reads of it; None when deleted, or unreadable: then it is unknown)."""
        name = (obj.get("metadata") or {}).get("name", "")
        if event == "DELETED":
            return name, None
        try:
            return name, raw_node(Node.model_validate(obj), self.resources, self.leaf_labels)
        except ValidationError as e:
            log.warning("node %s: unreadable, left out of the cache (%s)", name, e.errors(include_url=False)[0]["msg"])
            return name, None

    def apply_pod(self, event: str, obj: dict) -> None:
        """`event` ADDED | MODIFIED | DELETED; `obj` a v1.Pod as JSON (dict)."""
        key, entry = self._pod_entry(event, obj)
        with self._lock:
            _put(self._pods, key, entry)
            self._used = None

    def apply_node(self, event: str, obj: dict) -> None:
        """`event` ADDED | MODIFIED | DELETED; `obj` a v1.Node as JSON (dict)."""
        name, node = self._node_entry(event, obj)
        with self._lock:
            _put(self._nodes, name, node)

    def replace(self, kind: str, items: list[dict]) -> None:
        """A fresh LIST: what we had of that kind is dropped (deletions missed while away). The new
        state is built first and swapped in at once: a call in between sees the old one, not half."""
        entry = self._pod_entry if kind == "pods" else self._node_entry
        fresh: dict = {}
        for item in items:
            _put(fresh, *entry("ADDED", item))
        with self._lock:
            if kind == "pods":
                self._pods, self._used = fresh, None
            else:
                self._nodes = fresh
        if kind == "pods":
            self.synced.set()

    # -- PodView -----------------------------------------------------------------------
    def used_cards(self, node: str, resource: str) -> int | None:
        if not self.synced.is_set():
            return None  # before the first list, "unknown" is the honest answer
        with self._lock:
            if self._used is None:  # recounted once after changes, not once per node asked about
                used: dict[tuple[str, str], int] = {}
                for p in self._pods.values():
                    for r, n in p.cards.items():
                        used[p.node, r] = used.get((p.node, r), 0) + n
                self._used = used
            return self._used.get((node, resource), 0)

    def peers(self, namespace: str, job: str) -> Counter[str]:
        with self._lock:
            return Counter(p.node for p in self._pods.values() if p.job == job and p.namespace == namespace)

    def leaf_of(self, node: str) -> str | None:
        with self._lock:
            raw = self._nodes.get(node)
        return raw.leaf if raw is not None else None

    def raw_nodes(self, names: list[str]) -> list[RawNode | None]:
        with self._lock:
            get = self._nodes.get
            return [get(name) for name in names]

    # -- watching ------------------------------------------------------------------------
    def start(self, kube: KubeClient | None = None, relist_seconds: float = 2.0) -> None:
        """Follow pods and nodes in two daemon threads (list, then watch; see `_follow`)."""
        kube = kube or KubeClient()
        for kind in _KINDS:
            threading.Thread(
                target=self._follow, args=(kube, kind, relist_seconds), name=f"watch-{kind}", daemon=True
            ).start()

    def _follow(self, kube: KubeClient, kind: str, relist_seconds: float) -> None:
        """Keep `kind` equal to the API's: each listing replaces it, each event updates it. The
        client lists again itself when the server drops the version it follows; after any other
        failure (the API server away, a watch that broke off) this starts over `relist_seconds` later."""
        apply = self.apply_pod if kind == "pods" else self.apply_node
        while not self._stop.is_set():
            try:
                with closing(kube.watch("v1", _KINDS[kind])) as events:
                    for event in events:
                        if isinstance(event, Listed):
                            self.replace(kind, event.items)
                        else:
                            apply(event.type, event.object)
                        if self._stop.is_set():
                            return
            except Exception as e:
                log.warning("watch of %s failed (%s); relisting in %.0f s", kind, e, relist_seconds)
            self._stop.wait(relist_seconds)

    def stop(self) -> None:
        self._stop.set()


def _put(state: dict, key: str, value) -> None:
    """Set `key`, or drop it when `value` is None."""
    if value is None:
        state.pop(key, None)
    else:
        state[key] = value
