"""NVML discovery against a stand-in `pynvml` (this machine has no NVIDIA driver, so real NVML cannot run).

The stand-in answers the NVML calls NvmlDiscovery makes, with NVML's shapes (bytes from old
bindings, str from new ones, NVMLError on a timed-out event wait). On a GPU node the same
code runs against the real library.
"""

from __future__ import annotations

import sys
import types
from collections import deque

import pytest

from kubetune.cluster.devices.discovery import HEALTHY, UNHEALTHY
from kubetune.cluster.devices.factory import make_discovery


def _fake_nvml(gpus: list[dict], events: deque) -> types.ModuleType:
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    nv.NVMLError = NVMLError
    nv.nvmlEventTypeXidCriticalError = 8
    nv.nvmlInit = lambda: None
    nv.nvmlShutdown = lambda: None
    nv.nvmlDeviceGetCount = lambda: len(gpus)
    nv.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    nv.nvmlDeviceGetHandleByUUID = lambda u: next(
        g for g in gpus if g["uuid"] in (u, u.encode() if isinstance(u, str) else u)
    )
    nv.nvmlDeviceGetUUID = lambda h: h["uuid"]
    nv.nvmlDeviceGetName = lambda h: h["name"]
    nv.nvmlDeviceGetMinorNumber = lambda h: h["minor"]
    nv.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=h["bus"])
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=h["mem"], free=h.get("free", h["mem"]))
    nv.nvmlEventSetCreate = lambda: object()
    nv.nvmlEventSetFree = lambda s: None
    nv.nvmlDeviceRegisterEvents = lambda h, t, s: None

    def wait(event_set, timeout_ms):
        if not events:
            raise NVMLError("Timeout")
        device, xid = events.popleft()
        return types.SimpleNamespace(device=device, eventData=xid)

    nv.nvmlEventSetWait = wait
    return nv


def test_nvml_discovery_reads_gpus_numa_and_turns_critical_xids_unhealthy(tmp_path, monkeypatch):
    gpus = [
        {"uuid": b"GPU-aaa", "name": b"NVIDIA H200", "minor": 0, "bus": b"00000000:19:00.0", "mem": 141 * 2**30},
        {"uuid": "GPU-bbb", "name": "NVIDIA H200", "minor": 1, "bus": "00000000:9A:00.0", "mem": 141 * 2**30},
    ]
    gpus[1]["free"] = 100 * 2**30  # something outside Kubernetes holds 41 GiB of it
    for bus, numa in (("0000:19:00.0", "0"), ("0000:9a:00.0", "1")):
        (tmp_path / "bus/pci/devices" / bus).mkdir(parents=True)
        (tmp_path / "bus/pci/devices" / bus / "numa_node").write_text(numa + "\n")
    events: deque = deque()
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(gpus, events))

    d = make_discovery("nvml", "nvidia.com/gpu", sysfs_root=tmp_path)
    cards = d.devices()
    assert [(c.id, c.model, c.index, c.numa_node, c.hbm_mib) for c in cards] == [
        ("GPU-aaa", "NVIDIA H200", 0, 0, 141 * 1024),
        ("GPU-bbb", "NVIDIA H200", 1, 1, 141 * 1024),
    ]
    assert d.probe() == {"GPU-aaa": HEALTHY, "GPU-bbb": HEALTHY}
    assert d.free_memory_mib() == {"GPU-aaa": 141 * 1024, "GPU-bbb": 100 * 1024}
    events.append((gpus[1], 13))  # XID 13: an application error, not the GPU's fault
    assert d.probe()["GPU-bbb"] == HEALTHY
    events.append((gpus[1], 79))  # XID 79: fallen off the bus
    assert d.probe() == {"GPU-aaa": HEALTHY, "GPU-bbb": UNHEALTHY}
    assert d.allocate_spec(cards).envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-aaa,GPU-bbb"}
    d.close()


def test_nvml_without_the_package_is_a_user_error(monkeypatch):
    from kubetune.errors import UserError

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(UserError, match="nvidia-ml-py"):
        make_discovery("nvml", "nvidia.com/gpu")
