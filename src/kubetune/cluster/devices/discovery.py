"""The interface every backend of `kubetune.cluster.devices` implements, and what they share.

A `Discovery` backend answers three questions, and nothing about gRPC:

- `devices()`: the cards (id, model, accel index, OAM module, NUMA node, HBM, PCIe root, link
  domain),
- `probe()`: the health of each card right now (the health loop polls it),
- `allocate_spec(cards)`: device nodes and environment for a container given these cards,
- `free_memory_mib()`: free HBM per card now, where the backend can measure it (NVML).

The device plugin (`kubetune.cluster.deviceplugin`) and the DRA driver (`kubetune.cluster.dra`)
both sit on this one interface. Besides it: the card health constants, `DriverAbsent`, and the
sysfs readers the hardware backends share.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kubetune.errors import UserError

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


@dataclass(frozen=True)
class Card:
    """One accelerator card as the plugin advertises it (a whole card, never a slice)."""

    id: str  # the kubelet device id (<= 63 chars): PCI address for Gaudi, UUID for NVIDIA
    model: str  # gaudi2 | gaudi3 | the NVML product name
    index: int  # accel<N> / nvidia<N> minor: what HABANA_VISIBLE_DEVICES / device nodes use
    module_id: int | None = None  # OAM slot (Gaudi); None when unknown
    numa_node: int | None = None  # None when the platform reports -1 / nothing
    hbm_mib: int | None = None
    pci_address: str | None = None
    # Kubernetes' standard form of the card's PCIe root complex, `pci<domain>:<bus>` (the
    # resource.kubernetes.io/pcieRoot attribute NIC drivers publish too); None when sysfs
    # does not show it.
    pcie_root: str | None = None
    # Cards with equal values talk over direct links (Gaudi: the board's scale-up RoCE links;
    # NVIDIA: one NVLink fabric clique); None where the backend cannot tell.
    link_domain: str | None = None


@dataclass
class AllocateSpec:
    """What a container gets for a set of cards: translated 1:1 into ContainerAllocateResponse."""

    envs: dict[str, str] = field(default_factory=dict)
    device_nodes: list[str] = field(default_factory=list)  # host path == container path, "rw"


class Discovery(Protocol):
    """The interface every backend implements. The gRPC server only translates these answers."""

    resource: str

    def devices(self) -> list[Card]: ...

    def probe(self) -> dict[str, str]:
        """Card id -> HEALTHY | UNHEALTHY, now."""
        ...

    def allocate_spec(self, cards: list[Card]) -> AllocateSpec: ...

    def free_memory_mib(self) -> dict[str, int]:
        """Card id -> free HBM in MiB now, for the cards the backend can measure (others: absent)."""
        ...

    def close(self) -> None: ...


class DriverAbsent(UserError):
    """This node has no usable driver for the backend: no card, or the driver is not loaded (yet)."""


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def read_int(path: Path, base: int = 10) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


_PCIE_ROOT = re.compile(r"pci[0-9a-f]{4}:[0-9a-f]{2}")


def pcie_root(sysfs_root: Path, pci_address: str) -> str | None:
    """`pci0000:00` for a card whose sysfs device path runs under `/sys/devices/pci0000:00/...`.

    The same rule as Kubernetes' deviceattribute package: resolve `bus/pci/devices/<address>`
    (a symlink into `devices/`) and take its root-complex component. None without that link.
    """
    link = Path(sysfs_root) / "bus/pci/devices" / pci_address.lower()
    try:
        parts = link.resolve(strict=True).parts
    except OSError:
        return None
    return next((part for part in parts if _PCIE_ROOT.fullmatch(part)), None)
