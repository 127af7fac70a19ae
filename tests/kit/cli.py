"""`kubetune ARGS` the three ways the tests run it. Keep one real-process case per command beside
the in-process ones: only a process shows its start-up imports and its exit status as a shell does."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.kit.paths import REPO


def run_cli_subprocess(args: list[str], env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m kubetune ARGS` as a real process from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "kubetune", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        cwd=str(REPO),
    )


def _main(args: list[str]) -> int:
    """`kubetune.cli.main` with ARGS as its argv: its exit status (its UserError -> one line, exit 2)."""
    from kubetune import cli

    argv, sys.argv = sys.argv, ["kubetune", *args]
    try:
        cli.main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    return 0


def run_cli_in_process(args: list[str], capfd: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess:
    """`kubetune ARGS` in this process, its output read from fd 1 and 2 (what a process would
    print, the loggers' and native code's included): the CLI path without a process's seconds of
    imports."""
    capfd.readouterr()  # what earlier code printed is not this command's
    code = _main(args)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["kubetune", *args], code, out, err)


@dataclass
class CliResult:
    code: int
    out: str
    err: str


def run_cli_redirected(*args: str) -> CliResult:
    """`kubetune ARGS` in this process, its output read from sys.stdout and sys.stderr (no
    fixture needed: the k8s, operator, monitor and chart tests call it from helpers)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _main(list(args))
    return CliResult(code, out.getvalue(), err.getvalue())
