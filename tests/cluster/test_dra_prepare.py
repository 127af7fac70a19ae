"""Claim preparation without gRPC: what a claim must say before the driver hands out cards, the
checkpoint's crash window (entry written, spec file not yet), and an NVIDIA claim's CDI spec."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from kubetune.cluster.devices.discovery import HEALTHY, UNHEALTHY
from kubetune.cluster.devices.inventory import InventoryDiscovery
from kubetune.cluster.dra.cdi import Checkpoint
from kubetune.cluster.dra.prepare import ClaimError, ClaimRef, Preparer
from kubetune.contracts import dra

GAUDI = dra.VENDORS["gaudi"]
CDI_SCHEMA = Path(__file__).parent / "cdi"


def cdi_validator() -> jsonschema.Draft7Validator:
    defs = json.loads((CDI_SCHEMA / "defs.json").read_text())
    # defs.json names no $schema: read it as the draft-07 document schema.json is
    registry = Registry().with_resource("defs.json", Resource(contents=defs, specification=DRAFT7))
    return jsonschema.Draft7Validator(json.loads((CDI_SCHEMA / "schema.json").read_text()), registry=registry)


def _claim(uid: str, devices: list[str], pool: str = "n1", allocated: bool = True) -> dict:
    results = [{"request": "r", "driver": GAUDI.driver, "pool": pool, "device": d} for d in devices]
    status = {"allocation": {"devices": {"results": results}}} if allocated else {}
    return {"metadata": {"name": "c", "namespace": "ns", "uid": uid}, "status": status}


@pytest.fixture
def setup(tmp_path):
    inventory = tmp_path / "cards.yaml"
    inventory.write_text(yaml.safe_dump({"cards": [{"id": f"c{i}", "index": i} for i in range(2)]}))
    claims: dict[str, dict] = {}
    health = {"c0": HEALTHY, "c1": UNHEALTHY}
    preparer = Preparer(
        GAUDI,
        "n1",
        InventoryDiscovery(inventory),
        lambda: health,
        lambda ns, name: claims.get(name),
        tmp_path / "cdi",
        Checkpoint(tmp_path / "data" / "checkpoint.json"),
    )
    return preparer, claims, tmp_path


@pytest.mark.parametrize(
    ("claim", "message"),
    [
        (_claim("u1", ["gaudi-0"], allocated=False), "ResourceClaim ns/c is not allocated"),
        (_claim("other", ["gaudi-0"]), "has UID other, the kubelet asked for u1"),
        (_claim("u1", ["gaudi-0"], pool="n2"), f"has no device of {GAUDI.driver} on node n1"),
        (_claim("u1", ["gaudi-7"]), "devices gaudi-7 are not on node n1"),
        (_claim("u1", ["gaudi-0", "gaudi-1"]), "devices gaudi-1 are unhealthy now"),
    ],
)
def test_a_claim_that_cannot_be_served_is_refused_with_its_reason(setup, claim, message):
    preparer, claims, tmp = setup
    claims["c"] = claim
    with pytest.raises(ClaimError, match=message):
        preparer.prepare(ClaimRef("ns", "c", "u1"))
    assert not (tmp / "cdi").exists() or not list((tmp / "cdi").iterdir())  # nothing written for it


def test_a_checkpointed_claim_whose_spec_file_is_missing_gets_it_back(setup):
    preparer, claims, tmp = setup
    claims["c"] = _claim("u1", ["gaudi-0"])
    devices = preparer.prepare(ClaimRef("ns", "c", "u1"))
    (spec,) = (tmp / "cdi").iterdir()
    text = spec.read_text()
    spec.unlink()  # as after a crash between the checkpoint and the spec file
    del claims["c"]  # and the claim is no longer readable: the checkpoint alone answers
    reopened = Preparer(
        GAUDI,
        "n1",
        preparer.discovery,
        preparer.health,
        preparer.read_claim,
        tmp / "cdi",
        Checkpoint(tmp / "data" / "checkpoint.json"),
    )
    assert reopened.prepare(ClaimRef("ns", "c", "u1")) == devices
    assert spec.read_text() == text


def test_nvidia_cards_get_their_node_and_the_claims_uuids(tmp_path):
    inventory = tmp_path / "gpus.yaml"
    gpus = [{"id": f"GPU-{i}", "model": "NVIDIA H200", "index": i} for i in range(3)]
    inventory.write_text(yaml.safe_dump({"vendor": "nvidia", "cards": gpus}))
    nvidia = dra.VENDORS["nvidia"]
    claim = _claim("u2", ["gpu-2", "gpu-0"])
    for r in claim["status"]["allocation"]["devices"]["results"]:
        r["driver"] = nvidia.driver
    preparer = Preparer(
        nvidia,
        "n1",
        InventoryDiscovery(inventory),
        lambda: {g["id"]: HEALTHY for g in gpus},
        lambda ns, name: claim,
        tmp_path / "cdi",
        Checkpoint(tmp_path / "checkpoint.json"),
    )
    devices = preparer.prepare(ClaimRef("ns", "c", "u2"))
    assert [d.cdi_device_ids for d in devices] == [["kubetune.io/gpu=u2-gpu-2"], ["kubetune.io/gpu=u2-gpu-0"]]
    (path,) = (tmp_path / "cdi").iterdir()
    spec = json.loads(path.read_text())
    cdi_validator().validate(spec)
    assert spec["containerEdits"] == {"env": ["NVIDIA_VISIBLE_DEVICES=GPU-0,GPU-2"]}
    nodes = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]}
    assert nodes == {"u2-gpu-2": ["/dev/nvidia2"], "u2-gpu-0": ["/dev/nvidia0"]}  # CDI refuses empty device edits
