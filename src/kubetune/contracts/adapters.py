"""The adapter registry of a shared server (a ModelServer): one JSON file on the adapter volume,
`/adapters/registry.json`, that the operator's export Jobs write and every replica reads at start
(`kubetune serve BASE --adapter-registry /adapters/registry.json`) to load each registered adapter
before it reports ready.

    {"base": {"name": "...", "revision": "..."},
     "adapters": {"NAME": {"versions": {"v1": {"path": "/adapters/NAME/v1"}}, "weights": {"v1": 100}}}}

A version's served name is `NAME@vN`; the plain NAME is an alias that routes to the versions by
`weights`. Writes are atomic (a replica never reads half a file) and made under a lock beside
the file (two export Jobs finishing together must not lose each other's entry).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from kubetune.fsutil import atomic_write_text, file_lock

ROOT = "/adapters"  # where the adapter volume is mounted in replicas and export Jobs
REGISTRY_FILE = f"{ROOT}/registry.json"


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BaseModelId(_Closed):
    name: str
    revision: str | None = None


class AdapterVersion(_Closed):
    path: str


class RegisteredAdapter(_Closed):
    versions: dict[str, AdapterVersion] = Field(default_factory=dict)
    weights: dict[str, int] = Field(default_factory=dict)  # version -> percent of the alias's traffic


class AdapterRegistry(_Closed):
    base: BaseModelId
    adapters: dict[str, RegisteredAdapter] = Field(default_factory=dict)

    def served_names(self) -> dict[str, str]:
        """Every registered version as its served name (`NAME@vN`) -> its path."""
        return {
            served_name(name, version): entry.path
            for name, adapter in self.adapters.items()
            for version, entry in adapter.versions.items()
        }


def served_name(name: str, version: str) -> str:
    return f"{name}@{version}"


def adapter_dir(name: str, version: str, root: str = ROOT) -> str:
    return f"{root}/{name}/{version}"


def next_version(versions: list[str]) -> str:
    """v1, v2, ...: one more than the highest version given."""
    numbers = [int(v[1:]) for v in versions if v.startswith("v") and v[1:].isdigit()]
    return f"v{max(numbers, default=0) + 1}"


def read_registry(path: Path) -> AdapterRegistry | None:
    """The registry, None when the file does not exist yet."""
    path = Path(path)
    if not path.exists():
        return None
    return AdapterRegistry.model_validate_json(path.read_text())


def write_registry(path: Path, registry: AdapterRegistry) -> None:
    atomic_write_text(Path(path), registry.model_dump_json(indent=2, exclude_none=True) + "\n")


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


def register(path: Path, base: BaseModelId, name: str, version: str, adapter_path: str) -> AdapterRegistry:
    """Add NAME@version to the registry at `path` (created for `base` when missing); a first
    version takes all of the alias's traffic. Refuses an adapter of another base."""
    path = Path(path)
    with file_lock(_lock_path(path)):
        registry = read_registry(path) or AdapterRegistry(base=base)
        if registry.base.name != base.name or (base.revision or None) != (registry.base.revision or None):
            raise ValueError(
                f"the registry serves base {registry.base.name}@{registry.base.revision or 'default'}, "
                f"not {base.name}@{base.revision or 'default'}"
            )
        adapter = registry.adapters.setdefault(name, RegisteredAdapter())
        adapter.versions[version] = AdapterVersion(path=adapter_path)
        if not adapter.weights:
            adapter.weights = {version: 100}
        write_registry(path, registry)
        return registry


def unregister(path: Path, name: str, version: str) -> AdapterRegistry | None:
    """Remove NAME@version (its files stay); its alias weight goes with it."""
    path = Path(path)
    with file_lock(_lock_path(path)):
        registry = read_registry(path)
        if registry is None or name not in registry.adapters:
            return registry
        adapter = registry.adapters[name]
        adapter.versions.pop(version, None)
        adapter.weights.pop(version, None)
        if not adapter.versions:
            del registry.adapters[name]
        write_registry(path, registry)
        return registry
