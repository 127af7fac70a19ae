"""Stop before the OOM killer does: `KUBETUNE_MEMORY_BUDGET`.

The cluster job sets KUBETUNE_MEMORY_BUDGET to 95% of the pod's memory limit. After every
optimizer step each rank compares the memory the kernel cannot reclaim (anonymous memory
plus shared memory, i.e. /dev/shm, of the pod's cgroup: what the OOM killer counts) with the
budget. If any rank is over, every rank saves a checkpoint together and the run stops with
one line that names the knobs, so the work up to that step is kept and the fix is obvious,
instead of an OOMKilled pod that loses everything since the last checkpoint.

Outside a cgroup (or without the memory controller), the estimate is this process's
resident memory times the processes on this host.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

ENV = "KUBETUNE_MEMORY_BUDGET"
# cgroup v2, then v1: the unreclaimable part of the group's memory
CGROUP_STATS = (
    (Path("/sys/fs/cgroup/memory.stat"), ("anon", "shmem")),
    (Path("/sys/fs/cgroup/memory/memory.stat"), ("total_rss", "total_shmem")),
)


def budget_bytes() -> int | None:
    value = os.environ.get(ENV, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def limit_bytes() -> int:
    """The memory this pod may use: its cgroup's limit (v2, then v1), else the host's memory."""
    for path in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            value = path.read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 1 << 60:  # v1 writes a huge number for "no limit"
            return int(value)
    return int(psutil.virtual_memory().total)


def cgroup_unreclaimable(stats=CGROUP_STATS) -> int | None:
    for path, keys in stats:
        try:
            fields = dict(line.split() for line in path.read_text().splitlines() if line.count(" ") == 1)
        except OSError:
            continue
        if all(k in fields for k in keys):
            return sum(int(fields[k]) for k in keys)
    return None


def used_bytes(local_world_size: int) -> int:
    in_group = cgroup_unreclaimable()
    if in_group is not None:
        return in_group
    return psutil.Process().memory_info().rss * max(1, local_world_size)


def over_budget(local_world_size: int) -> str | None:
    """A one-line diagnosis when the pod's memory is over the budget, else None."""
    budget = budget_bytes()
    if budget is None:
        return None
    used = used_bytes(local_world_size)
    if used <= budget:
        return None
    gib = 1024**3
    return f"memory: {used / gib:.2f} GiB in use, over {ENV}={budget / gib:.2f} GiB (95% of the pod's limit)"


def advice(step: int, saved: str) -> str:
    return (
        f"stopped after step {step} and saved {saved} before the OOM killer would; lower "
        f"train.micro_batch_size (raise train.grad_accum to keep the batch), set "
        f"train.gradient_checkpointing=on, lower data.max_seq_len, or raise k8s.resources.memory; "
        f"then rerun to resume"
    )
