"""CDI spec files for prepared claims, and the checkpoint that lets unprepare outlive the process.

One spec file per claim, `<cdi dir>/<vendor>-<class>_<claim uid>.json`, as the example driver
names them: its devices are `<claim uid>-<device>` (never reused, since runtimes may cache
specs), each with the card's device nodes; the claim's environment (`HABANA_VISIBLE_DEVICES`,
`NVIDIA_VISIBLE_DEVICES`) sits in the file's top-level containerEdits, because one variable
has to list every card of the claim. Both come from the backend's `allocate_spec`, the same
translation the device plugin's Allocate uses.

The checkpoint (`<plugin data dir>/checkpoint.json`) holds, per claim UID, the answer given
and the spec written. It is written before the spec file on prepare and after it is removed
on unprepare, so a crash in between leaves an entry (which a repeated call finishes), never
an orphaned file nobody knows about. Writes are atomic (kubetune.fsutil).
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kubetune.cluster.devices.discovery import AllocateSpec
from kubetune.contracts import dra
from kubetune.fsutil import atomic_write_json

# 0.5.0: device names may begin with a digit (a claim UID may) and device nodes take hostPath.
CDI_VERSION = "0.5.0"


@dataclass(frozen=True)
class PreparedDevice:
    """One entry of NodePrepareResourceResponse.devices."""

    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]


@dataclass
class PreparedClaim:
    namespace: str
    name: str
    spec_file: str
    devices: list[PreparedDevice] = field(default_factory=list)
    spec: dict = field(default_factory=dict)


def spec_file_name(vendor: dra.DraVendor, claim_uid: str) -> str:
    return f"{vendor.cdi_kind.replace('/', '-')}_{claim_uid}.json"


def cdi_device_name(claim_uid: str, device_name: str) -> str:
    return f"{claim_uid}-{device_name}"


def qualified_id(vendor: dra.DraVendor, claim_uid: str, device_name: str) -> str:
    """The fully qualified CDI name the kubelet hands the runtime: `<vendor>/<class>=<name>`."""
    return f"{vendor.cdi_kind}={cdi_device_name(claim_uid, device_name)}"


def _edits(spec: AllocateSpec) -> dict:
    edits: dict = {}
    if spec.envs:
        edits["env"] = [f"{k}={v}" for k, v in sorted(spec.envs.items())]
    if spec.device_nodes:
        edits["deviceNodes"] = [{"path": p, "hostPath": p, "permissions": "rw"} for p in spec.device_nodes]
    return edits


def claim_spec(vendor: dra.DraVendor, claim_uid: str, claim: AllocateSpec, per_device: dict[str, AllocateSpec]) -> dict:
    """The CDI spec of one claim: `claim` for the whole claim (its env), `per_device` (device
    name -> that card's spec) for the device nodes of each CDI device."""
    spec: dict = {
        "cdiVersion": CDI_VERSION,
        "kind": vendor.cdi_kind,
        "devices": [
            {
                "name": cdi_device_name(claim_uid, name),
                "containerEdits": _edits(AllocateSpec(device_nodes=s.device_nodes)),
            }
            for name, s in per_device.items()
        ],
    }
    if claim.envs:
        spec["containerEdits"] = _edits(AllocateSpec(envs=claim.envs))
    return spec


class Checkpoint:
    """Prepared claims by UID, in one JSON file; thread-safe, re-read at start."""

    VERSION = 1

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self.claims: dict[str, PreparedClaim] = self._load()

    def _load(self) -> dict[str, PreparedClaim]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        claims = {}
        for uid, raw in data.get("claims", {}).items():
            devices = [PreparedDevice(**d) for d in raw.pop("devices", [])]
            claims[uid] = PreparedClaim(devices=devices, **raw)
        return claims

    def _save(self) -> None:
        atomic_write_json(
            self.path, {"version": self.VERSION, "claims": {u: asdict(c) for u, c in self.claims.items()}}
        )

    def get(self, uid: str) -> PreparedClaim | None:
        with self._lock:
            return self.claims.get(uid)

    def put(self, uid: str, claim: PreparedClaim) -> None:
        with self._lock:
            self.claims[uid] = claim
            self._save()

    def drop(self, uid: str) -> None:
        with self._lock:
            if self.claims.pop(uid, None) is not None:
                self._save()
