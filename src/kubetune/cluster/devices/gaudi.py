"""Gaudi cards from sysfs: what Intel's DRA driver reads, no HLML needed."""

from __future__ import annotations

import re
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


def gaudi_link_domain(model: str) -> str:
    """Gaudi cards of one host sit on one baseboard whose RoCE ports link every OAM module to
    every other (HLS-Gaudi2/3): one scale-up domain per model and host. The value only has to
    be equal within a node, because a claim's node-local devices all come from one node."""
    return f"{model}-board"


def gaudi_allocate_spec(cards: list[Card], total_cards: int) -> AllocateSpec:
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
        pci_id = read_int(pci_dir / "device", 16)
        if pci_id not in GAUDI_PCI_IDS:
            return None  # an unknown or older Habana part: not advertised
        model, hbm = GAUDI_PCI_IDS[pci_id]
        accel = sorted((pci_dir / "accel").glob("accel[0-9]*"))
        if not accel:
            return None  # bound but no accel node yet (driver still probing)
        numa = read_int(pci_dir / "numa_node")
        return Card(
            id=pci_dir.name,
            model=model,
            index=int(accel[0].name.removeprefix("accel")),
            module_id=read_int(pci_dir / "module_id"),
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
        return gaudi_allocate_spec(cards, len(self.devices()))

    def free_memory_mib(self) -> dict[str, int]:
        return {}  # sysfs has no memory use (that is HLML's); a card no container holds is taken as free

    def close(self) -> None:
        pass
