"""`make_discovery`: the CLI's `--discovery` choice -> a backend.

`make_discovery("sysfs" | "nvml" | "inventory:FILE")` picks one; with `wait_for_driver` the
hardware backends come wrapped in `WaitForDriver`, which answers "no cards" while the node has
no driver (`DriverAbsent`) and keeps looking, so the DaemonSet's pod keeps running there
instead of crash-looping.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from kubetune.cluster.devices.discovery import Discovery
from kubetune.cluster.devices.gaudi import SysfsGaudiDiscovery
from kubetune.cluster.devices.inventory import InventoryDiscovery
from kubetune.cluster.devices.nvidia import NvmlDiscovery
from kubetune.cluster.devices.wait import WaitForDriver
from kubetune.errors import UserError


def make_discovery(
    spec: str,
    resource: str,
    sysfs_root: Path = Path("/sys"),
    dev_root: Path = Path("/dev"),
    wait_for_driver: float | None = None,
) -> Discovery:
    """`sysfs` | `nvml` | `inventory:FILE` -> a backend (the CLI's --discovery).

    `wait_for_driver` (seconds): wrap sysfs / nvml in `WaitForDriver` (what the DaemonSet runs),
    instead of raising `DriverAbsent` on a node without the driver.
    """
    opener: Callable[[], Discovery] | None = None
    if spec == "sysfs":
        opener = functools.partial(SysfsGaudiDiscovery, resource, sysfs_root, dev_root)
    elif spec == "nvml":
        opener = functools.partial(NvmlDiscovery, resource, sysfs_root)
    if opener is not None:
        return WaitForDriver(resource, opener, wait_for_driver) if wait_for_driver else opener()
    if spec.startswith("inventory:") and len(spec) > len("inventory:"):
        return InventoryDiscovery(Path(spec.removeprefix("inventory:")), resource)
    raise UserError(f"--discovery {spec!r}: use sysfs, nvml or inventory:FILE")
