"""Bad input met inside torchrun's workers is one line and exit code 2, as in one process,
on every path that starts the agent (kubetune.training.launch); a crash keeps torch's report.

Real processes: `kubetune train` starts torch's elastic agent (torch.distributed.run) in
itself, which starts `python -m kubetune train` workers, as a local launch and a pod do."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kubetune.netutil import free_port
from tests.kit.paths import REPO
from tests.kit.processes import base_env, communicate_or_fail, pod_env

from ..conftest import for_processes

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 240  # a worker left waiting on a collective would hang the launch: never past this


@pytest.fixture
def dist_overrides(tiny_overrides):
    return for_processes(tiny_overrides)


def start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kubetune", "train", *args],
        env=env or base_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ended(proc: subprocess.Popen) -> tuple[int, list[str]]:
    """Exit code and stderr's non-empty lines; stdout must be empty for an error."""
    out, err = communicate_or_fail(proc, TIMEOUT_S)
    return proc.returncode, [line for line in (out + err).splitlines() if line.strip()]


def another_recipes_run(run: Path, overrides: list[str]) -> None:
    """`run` holds a finished run of a recipe that differs from `overrides` by its seed."""
    from kubetune.recipe import load_recipe
    from kubetune.rundir import RunDir

    RunDir(run).write_record(load_recipe(None, [*overrides, "train.seed=1234", f"output_dir={run}"]).recipe, "finished")


def workers(launcher: int) -> list[int]:
    """The `-m kubetune train` children of the agent, which runs in the launcher itself."""
    found = []
    for child in psutil.Process(launcher).children():
        with contextlib.suppress(psutil.Error):  # one that has just ended
            if "kubetune" in child.cmdline():
                found.append(child.pid)
    return found


def assert_one_line(rc: int, lines: list[str], words: str) -> None:
    assert rc == 2 and len(lines) == 1, "\n".join(lines)
    assert lines[0].startswith("kubetune: error: ") and words in lines[0], lines[0]


@pytest.mark.parametrize("launch", [["--nproc-per-node", "2"], []], ids=["nproc-per-node", "default"])
def test_another_recipes_run_dir_is_one_line(tmp_path, dist_overrides, launch):
    """The issue's rerun: refused once, by the launcher, before any worker or measurement."""
    run = tmp_path / "run"
    another_recipes_run(run, dist_overrides)
    rc, lines = ended(start([*launch, *dist_overrides, f"output_dir={run}"]))
    assert_one_line(rc, lines, "holds a finished run of a different recipe")


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_pod_with_two_processes_says_bad_input_once(tmp_path, dist_overrides):
    """A pod with nprocPerNode=2 (PET_* as the Kubeflow operator sets them): the launcher in
    the pod leaves the run directory to rank 0, which tells every worker; both stop with the
    same UserError, and the pod says it once."""
    run = tmp_path / "run"
    another_recipes_run(run, dist_overrides)
    port = str(free_port())
    rc, lines = ended(start([*dist_overrides, f"output_dir={run}"], env=pod_env(port)))
    assert_one_line(rc, lines, "holds a finished run of a different recipe")


def test_bad_input_in_one_worker_is_one_line(tmp_path, dist_overrides):
    """Only local rank 0 serves the metrics: a taken monitor.port stops it alone, while rank
    1 goes on to wait for it in a collective. The agent stops rank 1; one line, exit 2."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = start(["--nproc-per-node", "2", *dist_overrides, f"monitor.port={port}", f"output_dir={tmp_path / 'r'}"])
        rc, lines = ended(proc)
    assert_one_line(rc, lines, f"monitor.port {port}: cannot serve metrics")


def test_a_crashed_worker_keeps_torchs_report(tmp_path, dist_overrides):
    """A worker killed (no UserError): torch's lines about stopping the other worker and its
    whole failure report stay, and the exit code is not bad input's."""
    proc = start(["--nproc-per-node", "2", "--max-restarts", "0", *dist_overrides, f"output_dir={tmp_path / 'r'}"])
    deadline = time.monotonic() + TIMEOUT_S
    while len(started := workers(proc.pid)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.kill(started[-1], signal.SIGKILL)
    rc, lines = ended(proc)
    text = "\n".join(lines)
    assert rc == 1, text
    assert "Sending process" in text and "failed (exitcode: -9)" in text, text
    assert "kubetune: error: training processes failed:" in text, text
    assert "Root Cause (first observed failure)" in text and "Signal 9 (SIGKILL)" in text, text
