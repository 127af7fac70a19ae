"""Find the accelerator cards of this node, behind one interface.

A `Discovery` backend answers three questions, and nothing about gRPC:

- `devices()`: the cards (id, model, accel index, OAM module, NUMA node, HBM, PCIe root, link
  domain),
- `probe()`: the health of each card right now (the health loop polls it),
- `allocate_spec(cards)`: device nodes and environment for a container given these cards,
- `free_memory_mib()`: free HBM per card now, where the backend can measure it (NVML).

The device plugin and the DRA driver (`kubetune.cluster.dra`) both sit on this one interface.

Backends: Gaudi from sysfs (what Intel's DRA driver reads, no HLML needed), NVIDIA through
NVML (`nvidia-ml-py`, imported only when chosen), and an inventory YAML for demos and tests.
`make_discovery("sysfs" | "nvml" | "inventory:FILE")` picks one from the CLI flag; with
`wait_for_driver` the hardware backends come wrapped in `WaitForDriver`, which answers "no
cards" while the node has no driver (`DriverAbsent`) and keeps looking, so the DaemonSet's
pod keeps running there instead of crash-looping.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
import time
import uuid as uuid_mod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kubetune.errors import UserError

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

# PCI device id -> (model, HBM per card in MiB). Reference §5: 0x1020 Gaudi2 (96 GB HBM2e);
# 0x1030, 0x1060-0x1063 Gaudi3 (128 GB).
GAUDI_PCI_IDS: dict[int, tuple[str, int]] = {
    0x1020: ("gaudi2", 96 * 1024),
    0x1030: ("gaudi3", 128 * 1024),
    0x1060: ("gaudi3", 128 * 1024),
    0x1061: ("gaudi3", 128 * 1024),
    0x1062: ("gaudi3", 128 * 1024),
    0x1063: ("gaudi3", 128 * 1024),
}

HABANA_DRIVER_DIR = Path("bus/pci/drivers/habanalabs")


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


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path, base: int = 10) -> int | None:
    text = _read(path)
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


def gaudi_link_domain(model: str) -> str:
    """Gaudi cards of one host sit on one baseboard whose RoCE ports link every OAM module to
    every other (HLS-Gaudi2/3): one scale-up domain per model and host. The value only has to
    be equal within a node, because a claim's node-local devices all come from one node."""
    return f"{model}-board"


def _gaudi_allocate_spec(cards: list[Card], total_cards: int) -> AllocateSpec:
    """Device nodes and env the way Habana's plugin hands them out (reference §5)."""
    ordered = sorted(cards, key=lambda c: c.index)
    spec = AllocateSpec()
    for card in ordered:
        spec.device_nodes += [f"/dev/accel/accel{card.index}", f"/dev/accel/accel_controlD{card.index}"]
    minors = ",".join(str(c.index) for c in ordered)
    spec.envs["HABANA_VISIBLE_DEVICES"] = minors
    spec.envs["HL_VISIBLE_DEVICES"] = minors
    # The runtime needs the OAM modules only for a subset of the box (Habana's plugin does the same).
    modules = [c.module_id for c in ordered if c.module_id is not None]
    if len(ordered) < total_cards and len(modules) == len(ordered):
        spec.envs["HABANA_VISIBLE_MODULES"] = ",".join(str(m) for m in modules)
    return spec


class SysfsGaudiDiscovery:
    """Gaudi cards bound to the habanalabs driver, read from sysfs.

    `<sysfs_root>/bus/pci/drivers/habanalabs/<DBDF>/` holds `device` (PCI id), `module_id`,
    `numa_node` and `accel/accel<N>`. Health: the card is still bound to the driver (its
    DBDF directory exists) and both device nodes exist under `<dev_root>/accel/`.
    """

    def __init__(
        self, resource: str = "habana.ai/gaudi", sysfs_root: Path = Path("/sys"), dev_root: Path = Path("/dev")
    ):
        self.resource = resource
        self.sysfs_root = Path(sysfs_root)
        self.dev_root = Path(dev_root)
        self._cards: list[Card] | None = None

    @property
    def driver_dir(self) -> Path:
        return self.sysfs_root / HABANA_DRIVER_DIR

    def devices(self) -> list[Card]:
        if self._cards is None:
            self._cards = self._scan()
        return list(self._cards)

    def _scan(self) -> list[Card]:
        if not self.driver_dir.is_dir():
            raise DriverAbsent(
                f"--discovery sysfs: {self.driver_dir} does not exist; is the habanalabs driver loaded "
                "(or pass --sysfs-root pointing at a tree that has it)?"
            )
        cards = []
        for entry in sorted(self.driver_dir.iterdir()):
            if not re.fullmatch(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]", entry.name):
                continue  # bind, unbind, new_id, module, ...
            card = self._card(entry)
            if card is not None:
                cards.append(card)
        return sorted(cards, key=lambda c: c.index)

    def _card(self, pci_dir: Path) -> Card | None:
        pci_id = _read_int(pci_dir / "device", 16)
        if pci_id not in GAUDI_PCI_IDS:
            return None  # an unknown or older Habana part: not advertised
        model, hbm = GAUDI_PCI_IDS[pci_id]
        accel = sorted((pci_dir / "accel").glob("accel[0-9]*"))
        if not accel:
            return None  # bound but no accel node yet (driver still probing)
        numa = _read_int(pci_dir / "numa_node")
        return Card(
            id=pci_dir.name,
            model=model,
            index=int(accel[0].name.removeprefix("accel")),
            module_id=_read_int(pci_dir / "module_id"),
            numa_node=numa if numa is not None and numa >= 0 else None,
            hbm_mib=hbm,
            pci_address=pci_dir.name,
            pcie_root=pcie_root(self.sysfs_root, pci_dir.name),
            link_domain=gaudi_link_domain(model),
        )

    def probe(self) -> dict[str, str]:
        health = {}
        for card in self.devices():
            bound = (self.driver_dir / card.id).is_dir()
            nodes = all(
                (self.dev_root / "accel" / name).exists()
                for name in (f"accel{card.index}", f"accel_controlD{card.index}")
            )
            health[card.id] = HEALTHY if bound and nodes else UNHEALTHY
        return health

    def allocate_spec(self, cards: list[Card]) -> AllocateSpec:
        return _gaudi_allocate_spec(cards, len(self.devices()))

    def free_memory_mib(self) -> dict[str, int]:
        return {}  # sysfs has no memory use (that is HLML's); a card no container holds is taken as free

    def close(self) -> None:
        pass


class InventoryDiscovery:
    """Cards listed in a YAML file, for demos and tests.

    ```yaml
    vendor: habana            # habana | nvidia: which device nodes and env Allocate gives
    cards:
      - {id: card0, model: gaudi3, index: 0, module_id: 0, numa_node: 0, hbm_mib: 131072,
         pcie_root: pci0000:00, link_domain: board-a}
      - {id: card1, model: gaudi3, index: 1, module_id: 1, numa_node: 0, health: Unhealthy}
    ```

    `pcie_root` and `link_domain` are optional (None when absent), as on hardware that does not
    show them.

    The file is re-read on every probe, so editing `health:` flips a card at run time; an
    optional `hbm_free_mib:` per card stands for a measured free memory.
    """

    def __init__(self, path: Path, resource: str = "habana.ai/gaudi"):
        self.path = Path(path)
        self.resource = resource
        self._cards, self.vendor = self._load()[:2]

    def _load(self) -> tuple[list[Card], str, dict[str, str], dict[str, int]]:
        import yaml

        try:
            data = yaml.safe_load(self.path.read_text()) or {}
        except OSError as e:
            raise UserError(f"--discovery inventory:{self.path}: cannot read it ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise UserError(f"--discovery inventory:{self.path}: not valid YAML ({e})") from None
        vendor = data.get("vendor", "habana")
        if vendor not in ("habana", "nvidia"):
            raise UserError(f"--discovery inventory:{self.path}: `vendor` must be habana or nvidia, not {vendor!r}")
        cards, health, free, problems = [], {}, {}, []
        for i, raw in enumerate(data.get("cards") or []):
            try:
                card = Card(
                    id=str(raw["id"]),
                    model=str(raw.get("model", "gaudi3")),
                    index=int(raw.get("index", i)),
                    module_id=None if raw.get("module_id") is None else int(raw["module_id"]),
                    numa_node=None if raw.get("numa_node") is None else int(raw["numa_node"]),
                    hbm_mib=None if raw.get("hbm_mib") is None else int(raw["hbm_mib"]),
                    pcie_root=None if raw.get("pcie_root") is None else str(raw["pcie_root"]),
                    link_domain=None if raw.get("link_domain") is None else str(raw["link_domain"]),
                )
            except (KeyError, TypeError, ValueError) as e:
                problems.append(
                    f"--discovery inventory:{self.path}: cards[{i}] is invalid ({e!r}); each card needs `id`"
                )
                continue
            if len(card.id) > 63:
                problems.append(f"--discovery inventory:{self.path}: cards[{i}].id is longer than 63 characters")
            health[card.id] = HEALTHY if raw.get("health", HEALTHY) == HEALTHY else UNHEALTHY
            if isinstance(raw.get("hbm_free_mib"), int):
                free[card.id] = raw["hbm_free_mib"]
            cards.append(card)
        if not cards and not problems:
            problems.append(f"--discovery inventory:{self.path}: no `cards` listed")
        if len({c.id for c in cards}) != len(cards):
            problems.append(f"--discovery inventory:{self.path}: card ids are not unique")
        if problems:
            raise UserError(*problems)
        return cards, vendor, health, free

    def devices(self) -> list[Card]:
        return list(self._cards)

    def probe(self) -> dict[str, str]:
        try:
            health = self._load()[2]
        except UserError:
            return {c.id: UNHEALTHY for c in self._cards}  # a half-written file must not crash the loop
        return {c.id: health.get(c.id, UNHEALTHY) for c in self._cards}

    def allocate_spec(self, cards: list[Card]) -> AllocateSpec:
        if self.vendor == "nvidia":
            return _nvidia_allocate_spec(cards)
        return _gaudi_allocate_spec(cards, len(self._cards))

    def free_memory_mib(self) -> dict[str, int]:
        try:
            return self._load()[3]
        except UserError:
            return {}

    def close(self) -> None:
        pass


def _nvidia_allocate_spec(cards: list[Card]) -> AllocateSpec:
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
            numa = _read_int(self.sysfs_root / "bus/pci/devices" / pci / "numa_node")
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
        return _nvidia_allocate_spec(cards)

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


class WaitForDriver:
    """A hardware backend on a node that may have no driver: zero cards until it has one.

    The vendor plugins behave this way (NVIDIA's with `failOnInitError: false`): a DaemonSet
    pod on a node without the driver keeps running and advertises nothing, rather than exit
    and crash-loop. Opening the backend is tried again at most every `retry` seconds (from the
    health loop and the plugin's card check); a backend that opens but finds no card counts as
    absent too (the driver may still be probing), so the cards are picked up once they appear.
    A `UserError` that is not `DriverAbsent` (e.g. nvidia-ml-py missing from the image) is the
    image's fault and is raised at once.
    """

    def __init__(self, resource: str, open_backend: Callable[[], Discovery], retry: float = 5.0):
        self.resource = resource
        self.retry = retry
        self._open = open_backend
        self._backend: Discovery | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self.absent_reason: str | None = None
        self._backend_now()

    @property
    def present(self) -> bool:
        return self._backend is not None

    def _backend_now(self) -> Discovery | None:
        with self._lock:
            if self._backend is None and time.monotonic() >= self._next_try:
                self._next_try = time.monotonic() + self.retry
                self._backend = self._try_open()
            return self._backend

    def _try_open(self) -> Discovery | None:
        try:
            backend = self._open()
            cards = backend.devices()  # sysfs scans here, NVML when opened
        except DriverAbsent as e:
            self._absent(str(e))
            return None
        if not cards:
            backend.close()
            self._absent(f"the driver is there but no {self.resource} card is (yet)")
            return None
        if self.absent_reason is not None:
            log.warning("%s: driver found, %d cards: advertising them", self.resource, len(cards))
        self.absent_reason = None
        return backend

    def _absent(self, reason: str) -> None:
        if reason != self.absent_reason:  # one line per new state, not one per retry
            log.warning(
                "%s: no cards to advertise: %s. Advertising 0 cards and looking again every %g s "
                "(a node without these cards should not run this DaemonSet: render-components selects "
                "nodes by their Node Feature Discovery PCI labels, --node-selector to change it)",
                self.resource,
                reason,
                self.retry,
            )
        self.absent_reason = reason

    def devices(self) -> list[Card]:
        backend = self._backend_now()
        return backend.devices() if backend else []

    def probe(self) -> dict[str, str]:
        backend = self._backend_now()
        return backend.probe() if backend else {}

    def allocate_spec(self, cards: list[Card]) -> AllocateSpec:
        if self._backend is None:  # the plugin refuses unknown ids first: with no cards, every id is unknown
            raise UserError(f"{self.resource}: no cards on this node")
        return self._backend.allocate_spec(cards)

    def free_memory_mib(self) -> dict[str, int]:
        return self._backend.free_memory_mib() if self._backend is not None else {}

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()


def make_discovery(
    spec: str,
    resource: str,
    sysfs_root: Path = Path("/sys"),
    dev_root: Path = Path("/dev"),
    wait_for_driver: float | None = None,
) -> Discovery:
    """`sysfs` | `nvml` | `inventory:FILE` -> a backend (the CLI's --discovery).

    `wait_for_driver` (seconds): wrap sysfs / nvml in `WaitForDriver` (what the DaemonSet runs),
    instead of raising `DriverAbsent` on a node without the driver.
    """
    opener: Callable[[], Discovery] | None = None
    if spec == "sysfs":
        opener = functools.partial(SysfsGaudiDiscovery, resource, sysfs_root, dev_root)
    elif spec == "nvml":
        opener = functools.partial(NvmlDiscovery, resource, sysfs_root)
    if opener is not None:
        return WaitForDriver(resource, opener, wait_for_driver) if wait_for_driver else opener()
    if spec.startswith("inventory:") and len(spec) > len("inventory:"):
        return InventoryDiscovery(Path(spec.removeprefix("inventory:")), resource)
    raise UserError(f"--discovery {spec!r}: use sysfs, nvml or inventory:FILE")
