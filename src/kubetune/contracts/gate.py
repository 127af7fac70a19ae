"""The eval gate's verdict as the training side writes it and the cluster side reads it.

`kubetune train` writes the verdict into summary.json's `gate` (and lm-eval's results into its
`lm_eval`); the export Job (`kubetune export RUN --gate`) reads them from the run's volume and,
as Kubernetes lets a container say why it ended, writes them as its termination message
(`gate_message`); the operator, which cannot read the volume, reads that message back from the
export pod (`read_gate_message`, `read_lm_eval_message`), serves only when the gate passed and
shows both in the FineTune's status.
"""

from __future__ import annotations

import json
from typing import Any

TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath
VERDICT_KEYS = ("metric", "passed", "base", "tuned", "threshold", "rule", "reason")
MESSAGE_BYTES = 4096  # what Kubernetes keeps of a termination message


def line(result: dict[str, Any]) -> str:
    """gate: PASS perplexity 20.0000 -> 15.0000 (tuned <= base)"""
    word = "PASS" if result.get("passed") else "FAIL"
    base, tuned = _fmt(result.get("base")), _fmt(result.get("tuned"))
    against = f", threshold {result['threshold']:g}" if result.get("threshold") is not None else ""
    why = f"; {result['reason']}" if result.get("reason") else ""
    return f"gate: {word} {result.get('metric')} {base} -> {tuned} ({result.get('rule')}{against}){why}"


def gate_message(result: dict[str, Any] | None, lm_eval: dict[str, Any] | None = None) -> str:
    """The termination message of the export Job: one JSON object with the verdict and the
    lm-eval table (rounded to 4 places; left out where it would not fit Kubernetes' 4 KiB)."""
    out: dict[str, Any] = {}
    if result is not None:
        out["gate"] = {k: result.get(k) for k in VERDICT_KEYS}
    if lm_eval:
        out["lm_eval"] = {
            task: {m: {k: _rounded(v) for k, v in pair.items()} for m, pair in metrics.items()}
            for task, metrics in lm_eval.items()
        }
    text = json.dumps(out, separators=(",", ":"))
    if len(text.encode()) > MESSAGE_BYTES and "lm_eval" in out:
        del out["lm_eval"]
        text = json.dumps(out, separators=(",", ":"))
    return text


def _message(message: str | None) -> dict[str, Any]:
    try:
        found = json.loads(message or "")
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def read_gate_message(message: str | None) -> dict[str, Any] | None:
    """The verdict in a termination message, or None (another message, or none)."""
    gate = _message(message).get("gate")
    return gate if isinstance(gate, dict) and isinstance(gate.get("passed"), bool) else None


def read_lm_eval_message(message: str | None) -> dict[str, Any] | None:
    """The lm-eval table ({task: {metric: {base, tuned}}}) in a termination message, or None."""
    table = _message(message).get("lm_eval")
    return table if isinstance(table, dict) and table else None


def _rounded(x: Any) -> Any:
    return round(x, 4) if isinstance(x, float) else x


def _fmt(x: Any) -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x:.4f}"
