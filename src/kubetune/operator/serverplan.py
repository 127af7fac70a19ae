"""The operator's decisions about shared servers, pure: a FineTune's adapter on a ModelServer
(its name, version and path; whether its base is the server's), the registry the FineTunes make
together, and what each replica must load or unload to match it, with the backoff of a load
that failed. `modelserver.py` and `handlers.py` observe and act."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kubetune.contracts.adapter_volume import adapter_dir, next_version
from kubetune.contracts.adapters import version_name as served_name
from kubetune.k8s.modelserver import ModelServerSpec
from kubetune.recipe.schema import Recipe

ADAPTER_EXPORT_SUFFIX = "-adapter-export"
UNREGISTER_SUFFIX = "-adapter-unregister"
RETRY_CAP_S = 300.0


@dataclass(frozen=True)
class AdapterRef:
    """A FineTune's adapter on its server: status.adapter."""

    server: str
    name: str
    version: str
    path: str
    registered: bool = False

    @property
    def served_name(self) -> str:
        return served_name(self.name, self.version)

    def status(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "name": self.name,
            "version": self.version,
            "servedName": self.served_name,
            "path": self.path,
            "registered": self.registered,
        }

    @classmethod
    def from_status(cls, status: dict[str, Any] | None) -> AdapterRef | None:
        if not status or not status.get("version"):
            return None
        return cls(status["server"], status["name"], status["version"], status["path"], bool(status.get("registered")))


def new_adapter(server: str, name: str, taken: list[str], spec: ModelServerSpec) -> AdapterRef:
    """The next version of `name` on the server (`taken`: its versions already given out)."""
    version = next_version(taken)
    return AdapterRef(server, name, version, adapter_dir(name, version, spec.mount_path))


def version_claim(server: str, namespace: str, ref: AdapterRef, finetune: str) -> dict[str, Any]:
    """The ConfigMap that reserves `ref`'s version for `finetune` (its name is the lock)."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"{server}-adapter-{ref.name}-{ref.version}".lower())[:253].strip("-")
    labels = {"kubetune.io/model-server": server, "app.kubernetes.io/part-of": "kubetune"}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "data": {"finetune": finetune, "adapter": ref.name, "version": ref.version, "path": ref.path},
    }


def base_mismatch(recipe: Recipe, server: str, spec: ModelServerSpec) -> str | None:
    """Why the run's adapter cannot be served on `server`, naming both bases; None when it can."""
    trained = (recipe.model.name_or_path, recipe.model.revision or None)
    serves = (spec.base, spec.revision or None)
    if trained == serves:
        return None
    return (
        f"the adapter was trained on {_label(*trained)} but ModelServer {server} serves {_label(*serves)}: "
        "an adapter only fits the base it was trained on; serve it on a ModelServer of that base"
    )


def _label(name: str, revision: str | None) -> str:
    return f"{name}@{revision or 'default'}"


def is_deleting(obj: dict[str, Any]) -> bool:
    return bool(obj.get("metadata", {}).get("deletionTimestamp"))


def registry_of(server: str, finetunes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The server's registered adapters (served name -> status.adapters entry), from the FineTunes
    whose adapter was exported into it. A FineTune being deleted is out: its adapter unloads."""
    out: dict[str, dict[str, Any]] = {}
    for ft in finetunes:
        ref = AdapterRef.from_status((ft.get("status") or {}).get("adapter"))
        if ref is None or ref.server != server or not ref.registered or is_deleting(ft):
            continue
        out[ref.served_name] = {
            "name": ref.name,
            "version": ref.version,
            "servedName": ref.served_name,
            "path": ref.path,
            "finetune": ft["metadata"]["name"],
        }
    return dict(sorted(out.items()))


def taken_versions(name: str, server: str, finetunes: list[dict[str, Any]], listed: list[dict[str, Any]]) -> list[str]:
    """The versions of `name` given out on the server: by its FineTunes, and in its status."""
    refs = [AdapterRef.from_status((ft.get("status") or {}).get("adapter")) for ft in finetunes]
    versions = [r.version for r in refs if r is not None and r.server == server and r.name == name]
    return versions + [a["version"] for a in listed if a.get("name") == name]


_VERSIONED = re.compile(r"^.+@v\d+$")


def replica_changes(wanted: dict[str, str], loaded: set[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(to load: (served name, path), to unload) for one replica. Only versioned names are the
    operator's to unload: an alias or an adapter declared at the server's start is not."""
    to_load = [(name, path) for name, path in wanted.items() if name not in loaded]
    to_unload = sorted(n for n in loaded if _VERSIONED.match(n) and n not in wanted)
    return to_load, to_unload


@dataclass(frozen=True)
class LoadFailure:
    attempts: int
    next_try: float  # monotonic seconds
    reason: str


def failed_again(previous: LoadFailure | None, reason: str, now: float, base_s: float) -> LoadFailure:
    """A load failed (again): the next try waits base_s, 2 base_s, 4 base_s, ... up to RETRY_CAP_S."""
    attempts = (previous.attempts if previous else 0) + 1
    return LoadFailure(attempts, now + min(base_s * 2 ** (attempts - 1), RETRY_CAP_S), reason)


def loaded_condition_text(server: str, served: str, pods: list[dict[str, Any]]) -> tuple[bool, str, str]:
    """(loaded on every ready replica, reason, message) of one adapter, from the server's status.pods."""
    if not pods:
        return False, "NoReadyReplica", f"ModelServer {server} has no ready replica yet"
    lines, ok = [], True
    for pod in pods:
        failure = next((f for f in pod.get("failed") or [] if f.get("adapter") == served), None)
        if served in (pod.get("loaded") or []):
            lines.append(f"{pod['pod']}: loaded")
        elif failure is not None:
            ok = False
            lines.append(f"{pod['pod']}: load failed: {failure.get('reason', '')} (retrying)")
        else:
            ok = False
            lines.append(f"{pod['pod']}: loading")
    failed = any("load failed" in line for line in lines)
    return ok, "Loaded" if ok else ("LoadFailed" if failed else "Loading"), "\n".join(lines)


def alias_weights(registry: dict[str, dict[str, Any]], weights: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """alias NAME -> {NAME@vN: percent}: the ModelServer's spec.weights where it names registered
    versions, else (as the registry file reads without weights) the newest version takes it all."""
    versions: dict[str, list[str]] = {}
    for entry in registry.values():
        versions.setdefault(entry["name"], []).append(entry["version"])
    out = {}
    for alias, registered in sorted(versions.items()):
        wanted = {v: w for v, w in weights.get(alias, {}).items() if v in registered and w > 0}
        if not wanted:
            wanted = {max(registered, key=lambda v: int(v[1:]) if v[1:].isdigit() else 0): 100}
        out[alias] = {served_name(alias, v): w for v, w in sorted(wanted.items())}
    return out
