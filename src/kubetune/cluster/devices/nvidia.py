"""NVIDIA GPUs through NVML (`nvidia-ml-py`, imported only when this backend is chosen)."""

from __future__ import annotations

import contextlib
import uuid as uuid_mod
from pathlib import Path

from kubetune.cluster.devices.discovery import (
    HEALTHY,
    UNHEALTHY,
    AllocateSpec,
    Card,
    DriverAbsent,
    pcie_root,
    read_int,
)
from kubetune.errors import UserError


def nvidia_allocate_spec(cards: list[Card]) -> AllocateSpec:
    # As NVIDIA's plugin in its default envvar strategy: the container toolkit adds the nodes.
    return AllocateSpec(envs={"NVIDIA_VISIBLE_DEVICES": ",".join(c.id for c in sorted(cards, key=lambda c: c.index))})


class NvmlDiscovery:
    """NVIDIA GPUs through NVML (`nvidia-ml-py`); health from NVML critical XID events."""

    # XIDs NVIDIA's plugin ignores by default: application errors, not a broken GPU.
    IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})

    def __init__(self, resource: str = "nvidia.com/gpu", sysfs_root: Path = Path("/sys")):
        self.resource = resource
        self.sysfs_root = Path(sysfs_root)
        try:
            import pynvml
        except ImportError:
            raise UserError(
                "--discovery nvml: the nvidia-ml-py package is not installed; pip install 'kubetune[cluster]'"
            ) from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise DriverAbsent(
                f"--discovery nvml: NVML is not usable on this node ({e}); is the NVIDIA driver installed "
                "(and NVIDIA_DRIVER_CAPABILITIES=utility set, so the container toolkit mounts libnvidia-ml)?"
            ) from None
        self._nvml = pynvml
        self._cards = self._scan()
        self._unhealthy: set[str] = set()
        self._events = self._event_set()

    def _scan(self) -> list[Card]:
        nv = self._nvml
        cards = []
        for i in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(i)
            uuid = nv.nvmlDeviceGetUUID(handle)
            bus_id = nv.nvmlDeviceGetPciInfo(handle).busId
            bus_id = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
            pci = bus_id.lower()[-12:]  # NVML pads the domain to 8 digits
            numa = read_int(self.sysfs_root / "bus/pci/devices" / pci / "numa_node")
            name = nv.nvmlDeviceGetName(handle)
            cards.append(
                Card(
                    id=uuid.decode() if isinstance(uuid, bytes) else uuid,
                    model=name.decode() if isinstance(name, bytes) else name,
                    index=nv.nvmlDeviceGetMinorNumber(handle),
                    numa_node=numa if numa is not None and numa >= 0 else None,
                    hbm_mib=nv.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024),
                    pci_address=pci,
                    pcie_root=pcie_root(self.sysfs_root, pci),
                    link_domain=self._fabric_clique(handle),
                )
            )
        return cards

    def _fabric_clique(self, handle) -> str | None:
        """`<cluster uuid>.<clique id>` of a GPU in a multi-node NVLink fabric (GB200 NVL and the
        like; NVIDIA's own DRA driver names IMEX domains the same way); None on GPUs without a
        fabric, with older bindings, or while the fabric manager has not finished."""
        nv = self._nvml
        try:
            info = nv.nvmlDeviceGetGpuFabricInfo(handle)
        except (AttributeError, nv.NVMLError):  # no such call in old bindings; NOT_SUPPORTED on PCIe GPUs
            return None
        if getattr(info, "state", None) != getattr(nv, "NVML_GPU_FABRIC_STATE_COMPLETED", 3):
            return None
        # ctypes cuts a char array at its first NUL byte: pad it back; GPUs of one clique get the
        # same value either way, and equality is all the attribute is for.
        raw = bytes(info.clusterUuid)[:16].ljust(16, b"\0")
        if not any(raw):
            return None
        return f"{uuid_mod.UUID(bytes=raw)}.{info.cliqueId}"

    def _event_set(self):
        nv = self._nvml
        events = nv.nvmlEventSetCreate()
        for card in self._cards:
            handle = nv.nvmlDeviceGetHandleByUUID(card.id)
            with contextlib.suppress(nv.NVMLError):  # some GPUs (e.g. MIG-enabled) have no events: stay Healthy
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, events)
        return events

    def devices(self) -> list[Card]:
        return list(self._cards)

    def probe(self) -> dict[str, str]:
        nv = self._nvml
        try:
            event = nv.nvmlEventSetWait(self._events, 0)  # non-blocking: the health loop polls
        except nv.NVMLError:
            event = None  # NVML_ERROR_TIMEOUT: nothing happened
        if event is not None and event.eventData not in self.IGNORED_XIDS:
            uuid = nv.nvmlDeviceGetUUID(event.device)
            self._unhealthy.add(uuid.decode() if isinstance(uuid, bytes) else uuid)
        return {c.id: UNHEALTHY if c.id in self._unhealthy else HEALTHY for c in self._cards}

    def allocate_spec(self, cards: list[Card]) -> AllocateSpec:
        return nvidia_allocate_spec(cards)

    def free_memory_mib(self) -> dict[str, int]:
        nv, free = self._nvml, {}
        for card in self._cards:
            with contextlib.suppress(nv.NVMLError):  # a card NVML cannot read now: its size stands in
                free[card.id] = nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByUUID(card.id)).free // (1024 * 1024)
        return free

    def close(self) -> None:
        try:
            self._nvml.nvmlEventSetFree(self._events)
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass
