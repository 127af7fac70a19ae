"""Versions of a LoRA adapter, the alias that routes between them, and the registry file that lists
them: what the operator writes and `kubetune serve --adapter-registry` reads, without torch.

A served adapter name may carry a version, `NAME@vN` (N >= 1). The plain `NAME` is then an
alias: a request for it is answered by one of its versions, picked by weight (serve.native.models,
`Alias`). The registry is one JSON file on the adapter storage volume:

    {"base": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "main"},
     "adapters": {"support": {"versions": {"v1": {"path": "/adapters/support/v1"},
                                           "v2": {"path": "support/v2"}},
                              "weights": {"v1": 90, "v2": 10}}}}

A relative path is under the file's folder. `weights` may be left out: the highest version then
takes every request. It is written whole with `write_registry` (a temporary file, then a rename),
so a server starting while the operator writes reads the old file or the new one, never half.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kubetune.errors import UserError
from kubetune.fsutil import atomic_write_text

VERSION_KEY = re.compile(r"^v([1-9][0-9]*)$")
VERSIONED_NAME = re.compile(r"^(?P<alias>[^@]+)@(?P<version>v[1-9][0-9]*)$")
_CLOSED = ConfigDict(extra="forbid", frozen=True)


def version_name(alias: str, version: str) -> str:
    """("support", "v2") -> "support@v2", the name a version is served under."""
    return f"{alias}@{version}"


def split_version(name: str) -> tuple[str, str] | None:
    """ "support@v2" -> ("support", "v2"); None for a name without a version."""
    match = VERSIONED_NAME.match(name)
    return (match["alias"], match["version"]) if match else None


def check_adapter_name(name: str) -> str | None:
    """Why `name` cannot name an adapter (an '@' that is not a version), None when it can."""
    if "@" in name and split_version(name) is None:
        return f"{name!r}: an '@' in an adapter name starts its version, NAME@vN with N >= 1 (e.g. support@v2)"
    return None


def check_weights(weights: dict[str, int]) -> str | None:
    """Why these alias weights route nowhere or are not weights, None when they are good."""
    negative = sorted(k for k, w in weights.items() if w < 0)
    if negative:
        return f"{negative[0]}: a weight is a non-negative integer (got {weights[negative[0]]})"
    if not any(w > 0 for w in weights.values()):
        return "at least one weight must be above 0 (a weight of 0 takes a version out of the route)"
    return None


class Alias:
    """A name that routes requests to served adapters by weight, with smooth weighted round robin
    (nginx's): of every sum(weights) requests in a row, each target answers exactly its weight's
    share, spread out (90/10 sends one in ten to the second, not ten in a row). Exact rather
    than a random draw, so a canary's share does not wander at low traffic, and a test can
    count it. A weight of 0 keeps a target listed but sends it nothing (a rollback)."""

    def __init__(self, weights: dict[str, int]) -> None:
        why = check_weights(weights) if weights else "no targets"
        if why:
            raise ValueError(why)
        self.weights = dict(weights)
        self._current = dict.fromkeys(weights, 0)

    def pick(self) -> str:
        live = {t: w for t, w in self.weights.items() if w > 0}
        for target, weight in live.items():
            self._current[target] += weight
        chosen = max(live, key=lambda t: self._current[t])
        self._current[chosen] -= sum(live.values())
        return chosen


class BaseModelRef(BaseModel):
    """The base model every adapter of the registry was trained on."""

    model_config = _CLOSED

    name: str = Field(min_length=1)  # an HF id or a path; compared by its last part too
    revision: str | None = None


class AdapterVersion(BaseModel):
    model_config = _CLOSED

    path: str = Field(min_length=1)  # an adapter directory (PEFT) or a kubetune LoRA run directory


class RegisteredAdapter(BaseModel):
    model_config = _CLOSED

    versions: dict[str, AdapterVersion] = Field(min_length=1)
    weights: dict[str, int] = Field(default_factory=dict)  # version key -> weight; empty: the newest takes all

    @field_validator("versions")
    @classmethod
    def _version_keys(cls, versions: dict[str, AdapterVersion]) -> dict[str, AdapterVersion]:
        bad = [k for k in versions if not VERSION_KEY.match(k)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a version; versions are v1, v2, ...")
        return versions

    @model_validator(mode="after")
    def _weights_name_versions(self) -> RegisteredAdapter:
        unknown = sorted(set(self.weights) - set(self.versions))
        if unknown:
            raise ValueError(f"weights: {unknown[0]!r} is not one of its versions ({', '.join(self.versions)})")
        why = check_weights(self.weights) if self.weights else None
        if why:
            raise ValueError(f"weights: {why}")
        return self

    def route(self) -> dict[str, int]:
        """Version key -> weight, with the newest version at 100 where no weights are given."""
        if self.weights:
            return dict(self.weights)
        newest = max(self.versions, key=lambda k: int(k[1:]))
        return {newest: 100}


class AdapterRegistry(BaseModel):
    model_config = _CLOSED

    base: BaseModelRef
    adapters: dict[str, RegisteredAdapter] = Field(default_factory=dict)

    @field_validator("adapters")
    @classmethod
    def _names(cls, adapters: dict[str, RegisteredAdapter]) -> dict[str, RegisteredAdapter]:
        bad = [n for n in adapters if not n or "@" in n]
        if bad:
            raise ValueError(f"{bad[0]!r}: an adapter's name has no '@' (its versions are NAME@v1, ...)")
        return adapters

    def versions(self, folder: Path) -> list[tuple[str, Path]]:
        """(served name NAME@vN, its directory) of every version, relative paths under `folder`."""
        return [
            (version_name(name, key), _under(folder, v.path))
            for name, entry in self.adapters.items()
            for key, v in sorted(entry.versions.items(), key=lambda kv: int(kv[0][1:]))
        ]

    def aliases(self) -> dict[str, dict[str, int]]:
        """Alias NAME -> {NAME@vN: weight}."""
        return {
            name: {version_name(name, k): w for k, w in entry.route().items()} for name, entry in self.adapters.items()
        }


def _under(folder: Path, path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else folder / p


def read_registry(path: str | Path) -> AdapterRegistry:
    """The registry at `path`; one line naming the file and the field when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"--adapter-registry {path}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--adapter-registry {path}: not JSON ({e})") from None
    try:
        return AdapterRegistry.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        why = str(first["msg"]).removeprefix("Value error, ")
        raise UserError(f"--adapter-registry {path}: {where}: {why}") from None


def write_registry(path: str | Path, registry: AdapterRegistry) -> None:
    """Write the registry whole: a temporary file in the same folder, then a rename over `path`."""
    atomic_write_text(Path(path), registry.model_dump_json(indent=2, exclude_none=True) + "\n")
