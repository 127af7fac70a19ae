"""Where a shared server's adapters live: the adapter volume as its replicas and the operator's
export Jobs mount it, the registry file on it (`kubetune.contracts.adapters` is its schema), and
a version's directory there. Read by the renderers (`kubetune.k8s`), the operator and the
adapter-export Job's command (`kubetune.export.adapter_install`)."""

from __future__ import annotations

ROOT = "/adapters"  # where replicas and export Jobs mount the adapter volume
REGISTRY_NAME = "registry.json"
REGISTRY_FILE = f"{ROOT}/{REGISTRY_NAME}"


def adapter_dir(name: str, version: str, root: str = ROOT) -> str:
    """A version's directory on the volume: ROOT/NAME/vN."""
    return f"{root}/{name}/{version}"


def next_version(versions: list[str]) -> str:
    """v1, v2, ...: one more than the highest version given."""
    numbers = [int(v[1:]) for v in versions if v.startswith("v") and v[1:].isdigit()]
    return f"v{max(numbers, default=0) + 1}"
