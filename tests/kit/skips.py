"""An unexpected skip fails the run: a skipped test is one that silently stopped running (a tool or
package the bootstrap should have installed is missing), and CI would stay green without it.

The skips the suite expects are listed here, each with why; a skip whose reason names none of
them turns a passing run into a failing one and is listed in the summary. KUBETUNE_ALLOW_SKIPS=1
lets a run on a machine without the dev tools (kubectl, hadolint, ...) pass with its skips.
"""

from __future__ import annotations

import os

import pytest

ALLOW_ENV = "KUBETUNE_ALLOW_SKIPS"

# A part of a skip's reason -> why that skip is expected.
EXPECTED_SKIPS = {
    "vLLM is not installed": "vLLM is the optional GPU engine of `kubetune serve`; the CPU suite runs without it",
    "NVML works here": "on a host with an NVIDIA driver the NVML discovery test covers this fallback",
    "KUBETUNE_SKIP_PROMETHEUS=1": "the person running the suite asked to leave the Prometheus tests out",
    "KUBETUNE_DASHBOARD_PNG_DIR not set": "the dashboards render to PNG for the docs only when asked to",
}


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """What `pytest.skip(...)` (or a skipif, or importorskip) said."""
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def expected(reason: str) -> bool:
    return any(known in reason for known in EXPECTED_SKIPS)


class SkipGate:
    """Notes every skip of one session; fails the session on any skip EXPECTED_SKIPS does not name."""

    def __init__(self) -> None:
        self.unexpected: list[tuple[str, str]] = []

    def note(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail") and not expected(reason := skip_reason(report)):
            self.unexpected.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.note(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self.note(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unexpected and session.exitstatus == pytest.ExitCode.OK and os.environ.get(ALLOW_ENV) != "1":
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.unexpected:
            return
        verdict = "allowed by " + ALLOW_ENV if os.environ.get(ALLOW_ENV) == "1" else "the run fails"
        terminalreporter.section(f"unexpected skips ({verdict})", red=True)
        for nodeid, reason in self.unexpected:
            terminalreporter.line(f"{nodeid}: {reason}")
        terminalreporter.line(f"the expected skips are listed in tests/kit/skips.py; {ALLOW_ENV}=1 lets this run pass")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipGate(), "kubetune-skip-gate")
