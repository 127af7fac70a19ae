"""A finding: what `kubetune k8s doctor` and `kubetune monitor check` report, one per problem seen.

Both commands diagnose a snapshot into findings, print them their own way (doctor: a line and
its fix; check: one table row) and exit 1 when one is an error, so the record, the order of
severities and that exit rule live here once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

# "ok" is a check that passed (monitor check lists those too); "info" is a note with nothing to fix.
Severity = Literal["error", "warning", "info", "ok"]

SEVERITY_ORDER: dict[str, int] = {"error": 0, "warning": 1, "info": 2, "ok": 3}


@dataclass(frozen=True)
class Finding:
    severity: Severity
    subject: str  # what it concerns, e.g. "pod x-master-0", "PodMonitor ml/a"
    problem: str  # what is wrong (for an "ok" finding: what was seen)
    fix: str = ""  # how to fix it; empty where the problem says it already
    area: str = ""  # the group it is shown under, e.g. monitor check's targets | monitors | panels


def worst_first(findings: Iterable[Finding]) -> list[Finding]:
    """Errors first, then warnings, notes and passed checks; the order within one severity kept."""
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity])


def has_errors(findings: Iterable[Finding]) -> bool:
    """Whether the command should exit 1."""
    return any(f.severity == "error" for f in findings)
