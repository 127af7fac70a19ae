"""Training runs stopped after a checkpoint, the way a killed pod stops."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


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
