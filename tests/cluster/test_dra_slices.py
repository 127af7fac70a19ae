"""The pure slice builder: cards + health -> resource.k8s.io/v1 ResourceSlices (kubernetes-validate strict)."""

from __future__ import annotations

import kubernetes_validate
import pytest

from kubetune.cluster.devices.discovery import HEALTHY, UNHEALTHY, Card
from kubetune.cluster.dra.slices import MAX_DEVICES_PER_SLICE, build_slices
from kubetune.contracts import dra


def _cards(n: int) -> list[Card]:
    return [
        Card(
            id=f"0000:{0x19 + i:02x}:00.0",
            model="gaudi3",
            index=i,
            numa_node=i // 4,
            hbm_mib=128 * 1024,
            pcie_root=f"pci0000:{0x10 * (i // 4):02x}",
            link_domain="gaudi3-board",
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("version", ["1.34", "1.37"])
def test_slice_has_every_card_with_attributes_capacity_and_owner(version):
    cards = _cards(8)
    health = {c.id: HEALTHY for c in cards}
    health[cards[5].id] = UNHEALTHY
    (s,) = build_slices("node-a", "gaudi", cards, health, generation=3, node_uid="uid-1")
    kubernetes_validate.validate(s, version, strict=True)
    assert s["spec"]["driver"] == dra.VENDORS["gaudi"].driver
    assert s["spec"]["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": 1}
    assert s["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    devices = {d["name"]: d for d in s["spec"]["devices"]}
    assert list(devices) == [f"gaudi-{i}" for i in range(8)]
    five = devices["gaudi-5"]
    assert five["attributes"] == {
        dra.ATTR_MODEL: {"string": "gaudi3"},
        dra.ATTR_INDEX: {"int": 5},
        dra.ATTR_UUID: {"string": cards[5].id},
        dra.ATTR_HEALTHY: {"bool": False},
        dra.ATTR_NUMA_NODE: {"int": 1},
        dra.ATTR_LINK_DOMAIN: {"string": "gaudi3-board"},
        dra.ATTR_PCIE_ROOT: {"string": "pci0000:10"},
    }
    assert five["capacity"] == {dra.CAPACITY_MEMORY: {"value": "131072Mi"}}
    assert devices["gaudi-4"]["attributes"][dra.ATTR_HEALTHY] == {"bool": True}


def test_unknown_facts_are_left_out_and_big_nodes_split_into_one_pool():
    bare = Card(id="GPU-1", model="NVIDIA H200", index=0)
    (s,) = build_slices("n", dra.VENDORS["nvidia"], [bare], {}, generation=0)
    (d,) = s["spec"]["devices"]
    assert d["name"] == "gpu-0" and "capacity" not in d and "ownerReferences" not in s["metadata"]
    assert set(d["attributes"]) == {dra.ATTR_MODEL, dra.ATTR_INDEX, dra.ATTR_UUID, dra.ATTR_HEALTHY}
    assert d["attributes"][dra.ATTR_HEALTHY] == {"bool": False}  # health unknown: not offered
    many = build_slices("n", "gaudi", _cards(MAX_DEVICES_PER_SLICE + 1), {}, generation=2)
    assert [len(x["spec"]["devices"]) for x in many] == [MAX_DEVICES_PER_SLICE, 1]
    assert {x["spec"]["pool"]["resourceSliceCount"] for x in many} == {2}
    assert len({x["metadata"]["name"] for x in many}) == 2
    (empty,) = build_slices("n", "gaudi", [], {}, generation=1)
    assert empty["spec"]["devices"] == []
    kubernetes_validate.validate(empty, "1.34", strict=True)
