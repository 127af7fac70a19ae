"""Publish this node's accelerator facts on its Node object, for the scheduler extender.

`node_facts()` is pure: cards + health + which cards are in use -> annotations and labels
(keys in `kubetune.cluster.nodefacts`). `PodResourcesClient` asks the kubelet which device
ids running containers hold (PodResources API v1, gRPC on a unix socket). `NodePublisher`
merges the two and patches the Node through `KubeClient` (a merge patch of its metadata), only
when something changed. The ServiceAccount needs `get` and `patch` on nodes (see manifests.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from kubetune.cluster import nodefacts as keys
from kubetune.cluster.deviceplugin import DEFAULT_POD_RESOURCES_SOCKET
from kubetune.cluster.devices.discovery import HEALTHY, Card
from kubetune.kubeapi import KubeClient

log = logging.getLogger(__name__)


# Free memory is published in steps of this many MiB: a measured figure moves by a few MiB all
# the time, and every change is a patch of the Node.
HBM_STEP_MIB = 1024


def node_facts(
    resource: str,
    cards: list[Card],
    health: dict[str, str],
    in_use: set[str] | None,
    leaf: str | None,
    free_memory: dict[str, int] | None = None,
) -> tuple[dict, dict]:
    """-> (annotations, labels). `in_use` None = unknown, so neither `cards-free` nor `hbm-free-mib`
    is published. `free_memory`: measured free MiB per card id (NVML); a free card without a
    measurement counts with its whole HBM (whole cards: no container holds it)."""
    healthy = [c for c in cards if health.get(c.id) == HEALTHY]
    annotations = {
        keys.RESOURCE: resource,
        keys.CARDS_TOTAL: str(len(cards)),
        keys.CARDS_HEALTHY: str(len(healthy)),
    }
    if in_use is not None:
        free_cards = [c for c in healthy if c.id not in in_use]
        annotations[keys.CARDS_FREE] = str(len(free_cards))
        hbm_free = _hbm_free(free_cards, free_memory or {})
        if hbm_free is not None:
            annotations[keys.HBM_FREE_MIB] = hbm_free
    hbms = {c.hbm_mib for c in cards if c.hbm_mib}
    if len(hbms) == 1:
        annotations[keys.HBM_PER_CARD_MIB] = str(hbms.pop())
    elif hbms:
        annotations[keys.HBM_PER_CARD_MIB] = str(min(hbms))  # mixed box: promise the smallest
    numas = sorted({c.numa_node for c in cards if c.numa_node is not None})
    if numas:
        layout = []
        for n in numas:
            on = [c for c in cards if c.numa_node == n]
            layout.append(f"{n}:{sum(1 for c in on if health.get(c.id) == HEALTHY)}/{len(on)}")
        annotations[keys.NUMA_LAYOUT] = ",".join(layout)
    labels = {}
    models = {c.model for c in cards}
    if len(models) == 1:
        labels[keys.ACCELERATOR_LABEL] = _label_value(models.pop())
    if leaf:
        labels[keys.LEAF_LABEL] = _label_value(leaf)
    return annotations, labels


def _hbm_free(free_cards: list[Card], measured: dict[str, int]) -> str | None:
    """`131072,131072,98304`: free MiB of each free card, largest first ("" = no free card);
    None when a free card's memory is unknown (neither measured nor its size known)."""
    values = [measured.get(c.id, c.hbm_mib) for c in free_cards]
    if any(v is None for v in values):
        return None
    stepped = sorted((max(0, v) // HBM_STEP_MIB * HBM_STEP_MIB for v in values if v is not None), reverse=True)
    return ",".join(str(v) for v in stepped)


def _label_value(text: str) -> str:
    """Label values: <= 63 chars of [A-Za-z0-9._-], starting and ending alphanumeric."""
    cleaned = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in text)[:63]
    return cleaned.strip("._-") or "unknown"


class PodResourcesClient:
    """The kubelet's PodResources List: device ids of `resource` held by running containers."""

    def __init__(self, socket: Path = DEFAULT_POD_RESOURCES_SOCKET, timeout: float = 5.0):
        self.socket = Path(socket)
        self.timeout = timeout

    def in_use(self, resource: str) -> set[str] | None:
        """None when the kubelet cannot be asked (no socket, no permission, RPC error)."""
        import grpc

        from kubetune.cluster.deviceplugin.proto import podresources_pb2 as prpb
        from kubetune.cluster.deviceplugin.proto import podresources_pb2_grpc as prgrpc

        if not self.socket.exists():
            return None
        try:
            with grpc.insecure_channel(f"unix:{self.socket}") as channel:
                resp = prgrpc.PodResourcesListerStub(channel).List(prpb.ListPodResourcesRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            log.warning("PodResources List on %s failed: %s", self.socket, e.code())
            return None
        return {
            dev
            for pod in resp.pod_resources
            for container in pod.containers
            for devices in container.devices
            if devices.resource_name == resource
            for dev in devices.device_ids
        }


class NodePublisher:
    """Patches the Node with `node_facts()` when they change (and every `interval` seconds check)."""

    def __init__(
        self,
        node_name: str,
        resource: str,
        leaf_label: str | None,
        pod_resources: PodResourcesClient | None,
        kube: KubeClient | None = None,
        interval: float = 30.0,
        free_memory: Callable[[], dict[str, int]] | None = None,
    ):
        self.node_name = node_name
        self.resource = resource
        self.leaf_label = leaf_label
        self.pod_resources = pod_resources
        self.interval = interval
        self.free_memory = free_memory  # the backend's free_memory_mib
        self._kube = kube
        self._last: tuple[dict, dict] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def kube(self) -> KubeClient:
        if self._kube is None:  # connected at the first publish: the plugin serves devices without an API server
            self._kube = KubeClient()
        return self._kube

    def _leaf(self) -> str | None:
        if not self.leaf_label:
            return None
        node = self.kube.get("v1", "Node", self.node_name) or {}
        return ((node.get("metadata") or {}).get("labels") or {}).get(self.leaf_label)

    def publish(self, cards: list[Card], health: dict[str, str]) -> bool:
        """Patch the Node if the facts changed; True when a patch was sent."""
        with self._lock:
            in_use = self.pod_resources.in_use(self.resource) if self.pod_resources else None
            memory = self.free_memory() if self.free_memory else None
            annotations, labels = node_facts(self.resource, cards, health, in_use, self._leaf(), memory)
            if self._last == (annotations, labels):
                return False
            stamped = dict(
                annotations, **{keys.FACTS_UPDATED: datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
            )
            meta = {"name": self.node_name, "annotations": stamped, "labels": labels}
            self.kube.patch({"apiVersion": "v1", "kind": "Node", "metadata": meta})
            self._last = (annotations, labels)
            log.info("published node facts on %s: %s", self.node_name, annotations)
            return True

    def hook(self, state) -> None:
        """DevicePlugin.on_change: publish after a health change (state is a PluginState)."""
        with state.changed:
            health = dict(state.health)
        self.publish(list(state.cards.values()), health)

    def run(self, state) -> None:
        """Re-publish every `interval` seconds: pods finishing free cards without any event here."""
        while not self._stop.wait(self.interval):
            try:
                self.hook(state)
            except Exception as e:  # API server away: keep serving devices, try again later
                log.warning("publishing node facts failed: %s", e)

    def stop(self) -> None:
        self._stop.set()
