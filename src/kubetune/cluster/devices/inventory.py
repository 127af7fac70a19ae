"""Cards listed in a YAML file, for demos and tests (either vendor's device nodes and env)."""

from __future__ import annotations

from pathlib import Path

from kubetune.cluster.devices.discovery import HEALTHY, UNHEALTHY, AllocateSpec, Card
from kubetune.cluster.devices.gaudi import gaudi_allocate_spec
from kubetune.cluster.devices.nvidia import nvidia_allocate_spec
from kubetune.errors import UserError


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
            return nvidia_allocate_spec(cards)
        return gaudi_allocate_spec(cards, len(self._cards))

    def free_memory_mib(self) -> dict[str, int]:
        try:
            return self._load()[3]
        except UserError:
            return {}

    def close(self) -> None:
        pass
