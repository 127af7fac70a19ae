"""What the slices need from discovery: each card's PCIe root (from sysfs) and its link domain."""

from __future__ import annotations

import os
import sys
import types
from collections import deque

import yaml

from kubetune.cluster.devices.factory import make_discovery
from kubetune.cluster.devices.gaudi import SysfsGaudiDiscovery
from kubetune.cluster.devices.inventory import InventoryDiscovery

from .fakes import hls_box, make_gaudi_tree
from .test_nvml_discovery import _fake_nvml


def _link_under_root(sysfs, pci: str, root: str) -> None:
    """As the kernel lays it out: bus/pci/devices/<addr> -> ../../../devices/<root>/<bridge>/<addr>."""
    real = sysfs / "devices" / root / "0000:00:01.0" / pci
    real.mkdir(parents=True)
    (sysfs / "bus/pci/devices").mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(real, sysfs / "bus/pci/devices"), sysfs / "bus/pci/devices" / pci)


def test_gaudi_cards_carry_their_pcie_root_and_one_board_domain(tmp_path):
    box = hls_box("0x1060", 4)
    sysfs, dev = make_gaudi_tree(tmp_path / "node", box)
    for card in box[:3]:
        _link_under_root(sysfs, card["pci"], "pci0000:00" if card["accel"] < 2 else "pci0000:80")
    cards = SysfsGaudiDiscovery(sysfs_root=sysfs, dev_root=dev).devices()
    assert [c.pcie_root for c in cards] == ["pci0000:00", "pci0000:00", "pci0000:80", None]  # card 3: no link
    assert {c.link_domain for c in cards} == {"gaudi3-board"}


def test_nvml_link_domain_is_the_fabric_clique_where_there_is_one(tmp_path, monkeypatch):
    gpus = [
        {"uuid": "GPU-a", "name": "NVIDIA GB200", "minor": 0, "bus": "00000000:19:00.0", "mem": 2**30},
        {"uuid": "GPU-b", "name": "NVIDIA H100", "minor": 1, "bus": "00000000:9a:00.0", "mem": 2**30},
    ]
    _link_under_root(tmp_path, "0000:19:00.0", "pci0000:17")
    nv = _fake_nvml(gpus, deque())
    nv.NVML_GPU_FABRIC_STATE_COMPLETED = 3

    def fabric(handle):
        if handle["uuid"] == "GPU-b":
            raise nv.NVMLError("Not Supported")  # a PCIe GPU: no NVLink fabric
        return types.SimpleNamespace(clusterUuid=bytes(range(1, 17)), cliqueId=7, state=3)

    nv.nvmlDeviceGetGpuFabricInfo = fabric
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    cards = make_discovery("nvml", "nvidia.com/gpu", sysfs_root=tmp_path).devices()
    assert [(c.pcie_root, c.link_domain) for c in cards] == [
        ("pci0000:17", "01020304-0506-0708-090a-0b0c0d0e0f10.7"),
        (None, None),
    ]


def test_inventory_reads_pcie_root_and_link_domain(tmp_path):
    path = tmp_path / "cards.yaml"
    cards = [{"id": "a", "pcie_root": "pci0000:00", "link_domain": "board-1"}, {"id": "b"}]
    path.write_text(yaml.safe_dump({"cards": cards}))
    got = InventoryDiscovery(path).devices()
    assert [(c.pcie_root, c.link_domain) for c in got] == [("pci0000:00", "board-1"), (None, None)]
