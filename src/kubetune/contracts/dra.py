"""The Dynamic Resource Allocation (DRA) contract between kubetune's DRA driver and the claims
its jobs and servers render: driver names, DeviceClasses, device attribute names and the
Kubernetes version DRA needs.

The driver (`kubetune.cluster.dra`) publishes ResourceSlices with these attribute names; the
renderer (`kubetune.k8s`) writes CEL selectors and constraints over the same names. Both sides
import this module, so a renamed attribute cannot leave a selector matching nothing. Standard
library only: every layer may import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kubetune.errors import UserError

# resource.k8s.io/v1 (DRA GA) is served from Kubernetes 1.34 on; older clusters keep the device
# plugin path (extended resources such as habana.ai/gaudi).
DRA_MIN_VERSION = (1, 34)
RESOURCE_API_VERSION = "resource.k8s.io/v1"


@dataclass(frozen=True)
class DraVendor:
    """One vendor's DRA identity: what the driver registers and what claims ask for."""

    profile: str  # the recipe's k8s.profile this vendor serves (gaudi | nvidia)
    driver: str  # ResourceSlice spec.driver, the kubelet registration name, the attribute domain
    device_class: str  # the DeviceClass claims name (same as the driver, as upstream drivers do)
    cdi_kind: str  # CDI `kind` (<vendor>/<class>) of the spec files the driver writes
    visible_env: str  # the variable the container runtime reads to expose the cards
    extended_resource: str  # the device plugin's resource name for the same cards


VENDORS: dict[str, DraVendor] = {
    "gaudi": DraVendor(
        profile="gaudi",
        driver="gaudi.kubetune.io",
        device_class="gaudi.kubetune.io",
        cdi_kind="kubetune.io/gaudi",
        visible_env="HABANA_VISIBLE_DEVICES",
        extended_resource="habana.ai/gaudi",
    ),
    "nvidia": DraVendor(
        profile="nvidia",
        driver="gpu.kubetune.io",
        device_class="gpu.kubetune.io",
        cdi_kind="kubetune.io/gpu",
        visible_env="NVIDIA_VISIBLE_DEVICES",
        extended_resource="nvidia.com/gpu",
    ),
}

# Device attributes, in the driver's own domain (a selector reads
# device.attributes["<driver>"].<name>) unless qualified.
ATTR_MODEL = "model"  # string: gaudi2 | gaudi3 | the NVML product name
ATTR_INDEX = "index"  # int: accel<N> / nvidia<N> minor
ATTR_UUID = "uuid"  # string: the device plugin's card id (PCI address for Gaudi, UUID for NVIDIA)
ATTR_NUMA_NODE = "numaNode"  # int; absent when the platform does not say
ATTR_HEALTHY = "healthy"  # bool: the DeviceClass selects only healthy cards
ATTR_LINK_DOMAIN = "linkDomain"  # string: cards with equal values are linked directly (one board)
# Kubernetes' standardised attribute (k8s.io/dynamic-resource-allocation/deviceattribute): NIC
# drivers publish it too, so a claim can align cards and NICs on one PCIe root.
ATTR_PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
CAPACITY_MEMORY = "memory"  # Quantity: the card's HBM

# The recipe's alignment choices -> the attribute a matchAttribute constraint names.
ALIGN_ATTRIBUTES = {"pcie_root": ATTR_PCIE_ROOT, "numa_node": ATTR_NUMA_NODE, "link_domain": ATTR_LINK_DOMAIN}


def qualified(vendor: DraVendor, attribute: str) -> str:
    """The fully qualified attribute name (constraints need it): `<driver>/<name>` unless it
    already names its domain."""
    return attribute if "/" in attribute else f"{vendor.driver}/{attribute}"


def vendor_for(profile: str, field: str = "k8s.profile") -> DraVendor:
    """The vendor of a profile that has accelerators; a UserError naming `field` otherwise."""
    if profile not in VENDORS:
        raise UserError(
            f"{field}={profile}: DRA claims need accelerator cards; use gaudi or nvidia, or k8s.devices=plugin"
        )
    return VENDORS[profile]


def parse_version(text: str, field: str) -> tuple[int, int]:
    """`1.34`, `v1.34.2` -> (1, 34); a UserError naming `field` for anything else."""
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.\d+)?(?:[-+].*)?", text.strip())
    if not m:
        raise UserError(f"{field}={text!r} is not a Kubernetes version; write it as 1.34 (major.minor)")
    return int(m.group(1)), int(m.group(2))


def supports_dra(version: tuple[int, int]) -> bool:
    return version >= DRA_MIN_VERSION


def require_dra(version: tuple[int, int], field: str) -> None:
    """Refuse DRA on a cluster older than 1.34, in one line that says what to do instead."""
    if not supports_dra(version):
        have = ".".join(map(str, version))
        need = ".".join(map(str, DRA_MIN_VERSION))
        raise UserError(
            f"{field}: DRA (resource.k8s.io/v1) needs Kubernetes {need} or newer, this cluster is {have}; "
            f"use k8s.devices=plugin (the device plugin) or upgrade the cluster"
        )
