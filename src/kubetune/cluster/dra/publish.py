"""Keep this node's ResourceSlices equal to `build_slices()` of its cards, through the API server.

`SlicePublisher.publish(cards, health)` computes the slices, and only when their devices
differ from what it last wrote does it raise `pool.generation` and create / patch / delete
(consumers trust the highest generation of a pool, so every change needs a new one). On the
first call it reads the slices an earlier run of the driver left, continues their generation
and takes them over. `resync()` looks again: the kubelet deletes all of its node's slices when
it starts, and a driver's when the driver has been away a while, so what was written is not
what stays; the driver calls it on every registration and every resync interval. The ServiceAccount needs resourceslices
get/list/watch/create/update/patch/delete and nodes get (manifests.py renders it).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kubetune.cluster.devices.discovery import Card
from kubetune.cluster.dra.slices import build_slices
from kubetune.contracts import dra
from kubetune.kubeapi import ClusterError, KubeClient

log = logging.getLogger(__name__)


SLICE = (dra.RESOURCE_API_VERSION, "ResourceSlice")


def _content(slices: list[dict]) -> list[tuple[str, Any, int]]:
    """What a change is judged on: names and devices, not the generation."""
    return [(s["metadata"]["name"], s["spec"]["devices"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices]


def _generations(specs: dict[str, dict]) -> dict[str, int]:
    return {name: spec["pool"].get("generation", 0) for name, spec in specs.items()}


class SlicePublisher:
    """Writes the node's slices when the cards or their health change (thread-safe)."""

    def __init__(self, node_name: str, vendor: dra.DraVendor, kube: KubeClient):
        self.node_name = node_name
        self.vendor = vendor
        self.kube = kube
        self.generation: int | None = None  # None until the first publish has read the API
        self._node_uid: str | None = None
        self._written: dict[str, dict] = {}  # slice name -> spec last written
        self._last: list[tuple[str, Any, int]] | None = None
        self._lock = threading.Lock()

    def _adopt(self) -> None:
        """First call: take over the slices a previous run left, and continue their generation."""
        self._written = self._existing()
        self.generation = max((spec["pool"].get("generation", 0) for spec in self._written.values()), default=-1)
        self._node_uid = self._read_node_uid()

    def _read_node_uid(self) -> str | None:
        """The Node's uid, for the slices' owner reference; None when it cannot be read."""
        try:
            node = self.kube.get("v1", "Node", self.node_name)
        except ClusterError as e:
            log.warning("cannot read Node %s (%s): slices get no owner reference", self.node_name, e)
            return None
        if node is None:
            log.warning("Node %s does not exist: slices get no owner reference", self.node_name)
        return (node or {}).get("metadata", {}).get("uid")

    def _existing(self) -> dict[str, dict]:
        fields = {"spec.nodeName": self.node_name, "spec.driver": self.vendor.driver}
        return {s["metadata"]["name"]: s["spec"] for s in self.kube.list(*SLICE, fields=fields)}

    def resync(self, cards: list[Card], health: dict[str, str]) -> bool:
        """Write again if the API no longer holds the slices last written (deleted, or a pool of
        another generation). Only names and generations are compared: the API server writes
        quantities in its canonical form (131072Mi comes back as 128Gi)."""
        with self._lock:
            existing_differs = True
            if self.generation is not None:
                existing = self._existing()
                existing_differs = _generations(existing) != _generations(self._written)
                if existing_differs:
                    log.warning("%s: this node's ResourceSlices changed under us; writing again", self.vendor.driver)
                    self._written, self._last = existing, None
        return self.publish(cards, health) if existing_differs else False

    def publish(self, cards: list[Card], health: dict[str, str]) -> bool:
        """Bring the API's slices to these cards; True when something was written."""
        with self._lock:
            if self.generation is None:
                self._adopt()
            assert self.generation is not None
            desired = build_slices(self.node_name, self.vendor, cards, health, self.generation, self._node_uid)
            if self._last is not None and _content(desired) == self._last:
                return False
            self.generation += 1
            desired = build_slices(self.node_name, self.vendor, cards, health, self.generation, self._node_uid)
            self._write(desired)
            self._last = _content(desired)
            log.info(
                "%s: published %d devices on %s, pool generation %d",
                self.vendor.driver,
                len(cards),
                self.node_name,
                self.generation,
            )
            return True

    def _write(self, desired: list[dict]) -> None:
        for s in desired:
            name = s["metadata"]["name"]
            if name in self._written:
                # A JSON patch: a merge patch would keep attributes the new spec no longer has.
                self.kube.json_patch(*SLICE, name, [{"op": "replace", "path": "/spec", "value": s["spec"]}])
            else:
                self.kube.create(s)
        for name in set(self._written) - {s["metadata"]["name"] for s in desired}:
            self.kube.delete(*SLICE, name)
        self._written = {s["metadata"]["name"]: s["spec"] for s in desired}
