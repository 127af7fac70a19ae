"""NodePrepareResources / NodeUnprepareResources without gRPC: claims in, CDI files and answers out.

The request names a claim (namespace, name, UID); the driver reads the ResourceClaim, takes
the results of its own driver and pool (this node) from `status.allocation.devices.results`,
writes the claim's CDI spec and answers with the CDI ids. Anything wrong with one claim is that
claim's error string (the kubelet retries it), never an exception for the whole call. Both
calls are idempotent: a prepared claim answers from the checkpoint, an unknown one unprepares
to nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kubetune.cluster.devices.discovery import HEALTHY, AllocateSpec, Card, Discovery
from kubetune.cluster.dra import cdi
from kubetune.cluster.dra.slices import device_name
from kubetune.contracts import dra
from kubetune.fsutil import atomic_write_json
from kubetune.kubeapi import ClusterError, KubeClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str


class ClaimError(Exception):
    """What goes into one claim's `error` string."""


def claim_reader(kube: KubeClient) -> Callable[[str, str], dict | None]:
    """(namespace, name) -> the ResourceClaim as a dict, None when it does not exist."""

    def read(namespace: str, name: str) -> dict | None:
        try:
            return kube.get(dra.RESOURCE_API_VERSION, "ResourceClaim", name, namespace)
        except ClusterError as e:  # the API refused, or did not answer
            raise ClaimError(f"reading ResourceClaim {namespace}/{name}: {e}") from None

    return read


class Preparer:
    """Prepares and unprepares claims for one driver on one node."""

    def __init__(
        self,
        vendor: dra.DraVendor,
        node_name: str,
        discovery: Discovery,
        health: Callable[[], dict[str, str]],
        read_claim: Callable[[str, str], dict | None],
        cdi_dir: Path,
        checkpoint: cdi.Checkpoint,
    ):
        self.vendor = vendor
        self.node_name = node_name
        self.discovery = discovery
        self.health = health
        self.read_claim = read_claim
        self.cdi_dir = Path(cdi_dir)
        self.checkpoint = checkpoint

    def prepare(self, ref: ClaimRef) -> list[cdi.PreparedDevice]:
        """The devices of a claim, prepared (CDI file written); ClaimError when it cannot be."""
        done = self.checkpoint.get(ref.uid)
        if done is not None:
            path = Path(done.spec_file)
            if not path.exists():  # a crash between checkpoint and spec file: finish the write
                atomic_write_json(path, done.spec)
            return done.devices
        results = self._allocated(ref)
        cards = self._cards(results)
        per_device = {name: self._device_spec(card) for name, card in cards.items()}
        spec = cdi.claim_spec(self.vendor, ref.uid, self.discovery.allocate_spec(list(cards.values())), per_device)
        devices = [
            cdi.PreparedDevice(
                request_names=[r["request"]],
                pool_name=r["pool"],
                device_name=r["device"],
                cdi_device_ids=[cdi.qualified_id(self.vendor, ref.uid, r["device"])],
            )
            for r in results
        ]
        path = self.cdi_dir / cdi.spec_file_name(self.vendor, ref.uid)
        self.checkpoint.put(ref.uid, cdi.PreparedClaim(ref.namespace, ref.name, str(path), devices, spec))
        atomic_write_json(path, spec)
        log.info("prepared claim %s/%s (%s): %s", ref.namespace, ref.name, ref.uid, ", ".join(cards))
        return devices

    def _device_spec(self, card: Card) -> AllocateSpec:
        """One card's edits. CDI refuses a device whose edits are empty, and NVIDIA's spec is only an
        environment variable (the container toolkit adds the nodes), so an NVIDIA card gets its own
        node, `/dev/nvidia<minor>`, as the specs `nvidia-ctk cdi generate` writes list per GPU."""
        spec = self.discovery.allocate_spec([card])
        if not spec.device_nodes and self.vendor.profile == "nvidia":
            spec.device_nodes = [f"/dev/nvidia{card.index}"]
        return spec

    def _allocated(self, ref: ClaimRef) -> list[dict]:
        claim = self.read_claim(ref.namespace, ref.name)
        where = f"ResourceClaim {ref.namespace}/{ref.name}"
        if claim is None:
            raise ClaimError(f"{where} not found")
        uid = claim.get("metadata", {}).get("uid")
        if uid != ref.uid:
            raise ClaimError(f"{where} has UID {uid}, the kubelet asked for {ref.uid} (deleted and recreated?)")
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            raise ClaimError(f"{where} is not allocated")
        results = [
            r
            for r in allocation.get("devices", {}).get("results", [])
            if r.get("driver") == self.vendor.driver and r.get("pool") == self.node_name
        ]
        if not results:
            raise ClaimError(f"{where} has no device of {self.vendor.driver} on node {self.node_name}")
        return results

    def _cards(self, results: list[dict]) -> dict[str, Card]:
        by_name = {device_name(self.vendor, c): c for c in self.discovery.devices()}
        unknown = [r["device"] for r in results if r["device"] not in by_name]
        if unknown:
            raise ClaimError(f"devices {', '.join(unknown)} are not on node {self.node_name}")
        health = self.health()
        cards = {r["device"]: by_name[r["device"]] for r in results}
        sick = [name for name, card in cards.items() if health.get(card.id) != HEALTHY]
        if sick:
            raise ClaimError(f"devices {', '.join(sick)} are unhealthy now")
        return cards

    def unprepare(self, uid: str) -> None:
        """Remove the claim's CDI file and its checkpoint entry; nothing to do is not an error."""
        done = self.checkpoint.get(uid)
        if done is None:
            return
        Path(done.spec_file).unlink(missing_ok=True)
        self.checkpoint.drop(uid)
        log.info("unprepared claim %s/%s (%s)", done.namespace, done.name, uid)
