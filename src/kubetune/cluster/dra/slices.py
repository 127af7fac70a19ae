"""Cards + health -> the node's ResourceSlices (resource.k8s.io/v1), pure.

One pool per node, named after the node, as upstream drivers name node-local pools; a slice
holds at most 128 devices, so a bigger node gets several slices of one pool. Attribute and
capacity names are `kubetune.contracts.dra`'s, which the claims' CEL selectors read.
"""

from __future__ import annotations

from kubetune.cluster.devices.discovery import HEALTHY, Card
from kubetune.contracts import dra

MAX_DEVICES_PER_SLICE = 128  # resource.k8s.io/v1 ResourceSliceMaxDevices
MAX_STRING_ATTRIBUTE = 64  # DeviceAttribute string / version length limit

# Device name prefix per vendor: `gaudi-0`, `gpu-3` (DNS labels, stable across restarts because
# the accel / nvidia minor is).
DEVICE_PREFIX = {"gaudi": "gaudi", "nvidia": "gpu"}


def _vendor(vendor: dra.DraVendor | str) -> dra.DraVendor:
    return vendor if isinstance(vendor, dra.DraVendor) else dra.VENDORS[vendor]


def device_name(vendor: dra.DraVendor | str, card: Card) -> str:
    return f"{DEVICE_PREFIX[_vendor(vendor).profile]}-{card.index}"


def slice_name(node_name: str, vendor: dra.DraVendor | str, part: int = 0) -> str:
    """`<node>-<driver>` (a DNS subdomain: the driver's dots are allowed); `-<part>` after the first."""
    base = f"{node_name}-{_vendor(vendor).driver}"
    return base if part == 0 else f"{base}-{part}"


def device(vendor: dra.DraVendor | str, card: Card, healthy: bool) -> dict:
    """One `spec.devices[]` entry: the attributes a selector reads and the card's HBM."""
    attributes: dict[str, dict] = {
        dra.ATTR_MODEL: {"string": card.model[:MAX_STRING_ATTRIBUTE]},
        dra.ATTR_INDEX: {"int": card.index},
        dra.ATTR_UUID: {"string": card.id[:MAX_STRING_ATTRIBUTE]},
        dra.ATTR_HEALTHY: {"bool": healthy},
    }
    if card.numa_node is not None:
        attributes[dra.ATTR_NUMA_NODE] = {"int": card.numa_node}
    if card.link_domain is not None:
        attributes[dra.ATTR_LINK_DOMAIN] = {"string": card.link_domain[:MAX_STRING_ATTRIBUTE]}
    if card.pcie_root is not None:
        attributes[dra.ATTR_PCIE_ROOT] = {"string": card.pcie_root}
    entry: dict = {"name": device_name(vendor, card), "attributes": attributes}
    if card.hbm_mib:
        entry["capacity"] = {dra.CAPACITY_MEMORY: {"value": f"{card.hbm_mib}Mi"}}
    return entry


def build_slices(
    node_name: str,
    vendor: dra.DraVendor | str,
    cards: list[Card],
    health: dict[str, str],
    generation: int,
    node_uid: str | None = None,
) -> list[dict]:
    """The node's ResourceSlices: one pool named `node_name` at `generation`, every card with
    its attributes (`healthy` from `health`, a card it does not name counts as unhealthy) and
    HBM capacity, the Node as owner when `node_uid` is known (so the slices go with the Node).

    A node with no cards gets one slice without devices: the pool says "nothing here" instead
    of leaving an old generation standing. `vendor`: a `kubetune.contracts.dra.DraVendor` or its profile.
    """
    v = _vendor(vendor)
    ordered = sorted(cards, key=lambda c: c.index)
    chunks = [ordered[i : i + MAX_DEVICES_PER_SLICE] for i in range(0, len(ordered), MAX_DEVICES_PER_SLICE)] or [[]]
    slices = []
    for part, chunk in enumerate(chunks):
        metadata: dict = {
            "name": slice_name(node_name, v, part),
            "labels": {"app.kubernetes.io/managed-by": "kubetune-dra-driver"},
        }
        if node_uid:
            metadata["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
            ]
        slices.append(
            {
                "apiVersion": dra.RESOURCE_API_VERSION,
                "kind": "ResourceSlice",
                "metadata": metadata,
                "spec": {
                    "driver": v.driver,
                    "nodeName": node_name,
                    "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(chunks)},
                    "devices": [device(v, c, health.get(c.id) == HEALTHY) for c in chunk],
                },
            }
        )
    return slices
