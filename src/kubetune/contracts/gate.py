"""The eval gate's verdict as the training side writes it and the cluster side reads it.

`kubetune train` writes the verdict into summary.json's `gate`; the export Job
(`kubetune export RUN --gate`) reads it from the run's volume and, as Kubernetes lets a
container say why it ended, writes it as its termination message (`gate_message`); the
operator, which cannot read the volume, reads that message back from the export pod
(`read_gate_message`) and serves only when the gate passed.
"""

from __future__ import annotations

import json
from typing import Any

TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath
VERDICT_KEYS = ("metric", "passed", "base", "tuned", "threshold", "rule", "reason")


def line(result: dict[str, Any]) -> str:
    """gate: PASS perplexity 20.0000 -> 15.0000 (tuned <= base)"""
    word = "PASS" if result.get("passed") else "FAIL"
    base, tuned = _fmt(result.get("base")), _fmt(result.get("tuned"))
    against = f", threshold {result['threshold']:g}" if result.get("threshold") is not None else ""
    why = f"; {result['reason']}" if result.get("reason") else ""
    return f"gate: {word} {result.get('metric')} {base} -> {tuned} ({result.get('rule')}{against}){why}"


def gate_message(result: dict[str, Any]) -> str:
    """The termination message of the export Job: one JSON object (Kubernetes keeps 4 KiB)."""
    return json.dumps({"gate": {k: result.get(k) for k in VERDICT_KEYS}})


def read_gate_message(message: str | None) -> dict[str, Any] | None:
    """The verdict in a termination message, or None (another message, or none)."""
    try:
        found = json.loads(message or "")
    except ValueError:
        return None
    gate = found.get("gate") if isinstance(found, dict) else None
    return gate if isinstance(gate, dict) and isinstance(gate.get("passed"), bool) else None


def _fmt(x: Any) -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x:.4f}"
