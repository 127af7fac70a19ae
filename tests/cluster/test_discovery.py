"""Discovery from a fake sysfs tree, the inventory file, and NVML's absence."""

from __future__ import annotations

import time

import pytest

from kubetune.cluster.devices.discovery import HEALTHY, UNHEALTHY
from kubetune.cluster.devices.factory import make_discovery
from kubetune.cluster.devices.gaudi import SysfsGaudiDiscovery
from kubetune.cluster.devices.inventory import InventoryDiscovery
from kubetune.errors import UserError

from .fakes import hls_box, make_gaudi_tree


def test_sysfs_reads_gaudi2_and_gaudi3_with_numa_and_modules(tmp_path):
    cards = [
        {"pci": "0000:19:00.0", "device": "0x1020", "accel": 0, "module": 2, "numa": 0},
        {"pci": "0000:b3:00.0", "device": "0x1060", "accel": 1, "module": 5, "numa": 1},
        {"pci": "0000:b4:00.0", "device": "0x1030", "accel": 2, "module": 6, "numa": -1},
    ]
    sysfs, dev = make_gaudi_tree(tmp_path, cards)
    found = SysfsGaudiDiscovery(sysfs_root=sysfs, dev_root=dev).devices()
    assert [(c.id, c.model, c.index, c.module_id, c.numa_node) for c in found] == [
        ("0000:19:00.0", "gaudi2", 0, 2, 0),
        ("0000:b3:00.0", "gaudi3", 1, 5, 1),
        ("0000:b4:00.0", "gaudi3", 2, 6, None),  # numa_node -1 = no NUMA information
    ]
    assert [c.hbm_mib for c in found] == [96 * 1024, 128 * 1024, 128 * 1024]


def test_sysfs_skips_unknown_pci_ids_and_driver_files(tmp_path):
    cards = hls_box(n=2) + [{"pci": "0000:ff:00.0", "device": "0x1000", "accel": 9, "module": 9, "numa": 0}]  # Gaudi1
    sysfs, dev = make_gaudi_tree(tmp_path, cards)
    assert [c.index for c in SysfsGaudiDiscovery(sysfs_root=sysfs, dev_root=dev).devices()] == [0, 1]


def test_sysfs_health_needs_device_nodes_and_bound_driver(tmp_path):
    sysfs, dev = make_gaudi_tree(tmp_path, hls_box(n=3))
    d = SysfsGaudiDiscovery(sysfs_root=sysfs, dev_root=dev)
    ids = [c.id for c in d.devices()]
    assert set(d.probe().values()) == {HEALTHY}
    (dev / "accel" / "accel_controlD1").unlink()  # device node gone
    import shutil

    shutil.rmtree(sysfs / "bus/pci/drivers/habanalabs" / ids[2])  # unbound from the driver
    assert d.probe() == {ids[0]: HEALTHY, ids[1]: UNHEALTHY, ids[2]: UNHEALTHY}


def test_sysfs_without_driver_is_a_user_error_naming_the_flag(tmp_path):
    with pytest.raises(UserError, match="--sysfs-root"):
        SysfsGaudiDiscovery(sysfs_root=tmp_path, dev_root=tmp_path).devices()


def test_waiting_for_the_driver_means_no_cards_and_a_reason_then_a_look_every_retry(tmp_path):
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    d = make_discovery("sysfs", "habana.ai/gaudi", sysfs, dev, wait_for_driver=3600)
    assert d.devices() == [] and d.probe() == {} and not d.present
    assert "bus/pci/drivers/habanalabs does not exist" in d.absent_reason
    make_gaudi_tree(tmp_path, hls_box(n=2))
    assert d.devices() == []  # not looked at again before `retry` seconds
    (tmp_path / "sys/bus/pci/drivers/habanalabs/0000:19:00.0/device").write_text("0x1000\n")  # a Gaudi1 only
    (tmp_path / "sys/bus/pci/drivers/habanalabs/0000:29:00.0/device").write_text("0x1000\n")
    loaded_no_cards = make_discovery("sysfs", "habana.ai/gaudi", sysfs, dev, wait_for_driver=0.01)
    assert not loaded_no_cards.present and "no habana.ai/gaudi card" in loaded_no_cards.absent_reason
    (tmp_path / "sys/bus/pci/drivers/habanalabs/0000:29:00.0/device").write_text("0x1060\n")
    time.sleep(0.02)
    assert [c.id for c in loaded_no_cards.devices()] == ["0000:29:00.0"] and loaded_no_cards.present


def test_gaudi_allocate_spec_modules_only_for_a_subset(tmp_path):
    sysfs, dev = make_gaudi_tree(tmp_path, hls_box(n=4))
    d = SysfsGaudiDiscovery(sysfs_root=sysfs, dev_root=dev)
    cards = d.devices()
    part = d.allocate_spec([cards[2], cards[1]])
    assert part.envs["HABANA_VISIBLE_DEVICES"] == "1,2"
    assert part.envs["HABANA_VISIBLE_MODULES"] == "1,2"
    assert part.device_nodes == [
        "/dev/accel/accel1",
        "/dev/accel/accel_controlD1",
        "/dev/accel/accel2",
        "/dev/accel/accel_controlD2",
    ]
    whole = d.allocate_spec(cards)
    assert whole.envs["HABANA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert "HABANA_VISIBLE_MODULES" not in whole.envs


def test_inventory_reads_cards_and_rereads_health(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "vendor: nvidia\ncards:\n  - {id: GPU-a, index: 0, numa_node: 0}\n  - {id: GPU-b, index: 1, numa_node: 1}\n"
    )
    d = make_discovery(f"inventory:{inv}", "nvidia.com/gpu")
    assert isinstance(d, InventoryDiscovery)
    assert d.probe() == {"GPU-a": HEALTHY, "GPU-b": HEALTHY}
    inv.write_text(inv.read_text().replace("numa_node: 1}", "numa_node: 1, health: Unhealthy}"))
    assert d.probe() == {"GPU-a": HEALTHY, "GPU-b": UNHEALTHY}
    assert d.allocate_spec(d.devices()).envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"}


def test_inventory_problems_are_collected(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("vendor: amd\ncards:\n  - {model: gaudi3}\n")
    with pytest.raises(UserError) as e:
        InventoryDiscovery(inv)
    assert len(e.value.problems) == 1 and "vendor" in e.value.problems[0]
    inv.write_text("cards:\n  - {model: gaudi3}\n  - {id: x}\n  - {id: x}\n")
    with pytest.raises(UserError) as e:
        InventoryDiscovery(inv)
    assert any("cards[0]" in p for p in e.value.problems) and any("unique" in p for p in e.value.problems)


def test_unknown_discovery_and_missing_nvml_are_user_errors():
    with pytest.raises(UserError, match="sysfs, nvml or inventory:FILE"):
        make_discovery("pci", "habana.ai/gaudi")
    # This machine has nvidia-ml-py but no NVIDIA driver: the error must say so, not crash.
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        with pytest.raises(UserError, match="--discovery nvml"):
            make_discovery("nvml", "nvidia.com/gpu")
    else:  # pragma: no cover - only on a GPU node
        pynvml.nvmlShutdown()
        pytest.skip("NVML works here; covered by the NVML discovery itself")
