"""What the serving process may use of the machine it runs on: the CPU quota and memory
limit of its container (cgroup v2, then v1). Whether it computes in bf16 is measured, like
training's precision (kubetune.models.kernels).

A pod sees every core and all of the node's memory through os.cpu_count() and /proc/meminfo;
sizing threads or the KV cache from those is how CPU servers end up throttled or OOM-killed.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_quota(root: Path = CGROUP) -> float | None:
    """CPUs the container may use (cgroup `cpu.max` quota / period), None when unlimited."""
    text = _read(root / "cpu.max")
    if text:
        quota, _, period = text.partition(" ")
        if quota != "max" and period:
            return int(quota) / int(period)
        return None
    quota_v1, period_v1 = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
    if quota_v1 and period_v1 and int(quota_v1) > 0:
        return int(quota_v1) / int(period_v1)
    return None


def threads(root: Path = CGROUP) -> int:
    """Intra-op threads: the CPU quota (rounded down, at least 1), else the CPUs this process may run on."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota(root)
    return max(1, min(available, int(quota))) if quota else available


def memory_limit(root: Path = CGROUP) -> int | None:
    """The container's memory limit in bytes (cgroup v2 `memory.max`, v1 `limit_in_bytes`), None when unlimited."""
    text = _read(root / "memory.max")
    if text and text != "max":
        return int(text)
    text = _read(root / "memory" / "memory.limit_in_bytes")
    if text and int(text) < (1 << 60):  # v1 says "no limit" with a huge number
        return int(text)
    return None


def available_memory() -> int:
    """Bytes the system could still give this process (MemAvailable), for hosts without a limit."""
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 4 << 30
