"""`kubetune` as real processes: started in a clean environment, awaited (a hung one killed with
its tree), and stopped after a checkpoint, the way a killed pod stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.kit.paths import REPO


def base_env(**extra) -> dict:
    """This environment without a launcher's variables (PET_*, RANK, ...), with this tree's kubetune first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update({"PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}, **extra)
    return env


def pod_env(port: str, nproc_per_node: int = 2) -> dict:
    """One PyTorchJob pod with nprocPerNode processes: the PET_* variables the Kubeflow operator sets."""
    return base_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        WORLD_SIZE=str(nproc_per_node),
        RANK="0",
        PET_MASTER_ADDR="127.0.0.1",
        PET_MASTER_PORT=port,
        PET_NNODES="1",
        PET_NODE_RANK="0",
        PET_NPROC_PER_NODE=str(nproc_per_node),
    )


def start_kubetune(args: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
    """`python -m kubetune ARGS` from the repository root, stdout and stderr in one pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "kubetune", *args],
        env=env or base_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def communicate_or_fail(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The process's stdout and stderr; past `timeout` its whole tree is killed and the test fails."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s; output:\n{(out or '')[-6000:]}\n{(err or '')[-3000:]}")
    return out or "", err or ""


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """The output of a process that must exit 0."""
    out, _ = communicate_or_fail(proc, timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def wait_for_checkpoint(run: Path, step: int, *procs: subprocess.Popen, timeout: float = 240) -> Path:
    """RUN's checkpoint of STEP once it is complete (meta.json is written last); fails with the
    output of a process of PROCS that exits first."""
    meta = run / "checkpoints" / f"step-{step}" / "meta.json"
    deadline = time.monotonic() + timeout
    while not meta.exists():
        exited = [p for p in procs if p.poll() is not None]
        assert not exited, [p.stdout.read()[-3000:] for p in exited if p.stdout]
        assert time.monotonic() < deadline, f"no checkpoint of step {step} in {run} after {timeout:.0f} s"
        time.sleep(0.05)
    return meta.parent


def kill_after_checkpoint(proc: subprocess.Popen, run: Path, step: int, timeout: float = 240) -> None:
    """SIGKILL `proc` (no chance to save or clean up) once RUN's checkpoint of STEP is complete."""
    wait_for_checkpoint(run, step, proc, timeout=timeout)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
