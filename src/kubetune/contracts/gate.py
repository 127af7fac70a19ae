"""The eval gate's verdict as the training side writes it and the cluster side reads it.

`kubetune train` writes the verdict into summary.json's `gate` (and lm-eval's results into its
`lm_eval`); the export Job (`kubetune export RUN --gate`) reads them from the run's volume and,
as Kubernetes lets a container say why it ended, writes them as its termination message
(`gate_message`); the operator, which cannot read the volume, reads that message back from the
export pod (`read_gate_message`, `read_lm_eval_message`), serves only when the gate passed and
shows both in the FineTune's status.

An export Job that registers the model (`--register`, after the gate passed) adds what the
registry answered (`registered`: registry, name, version, uri) or, when it refused, the one line
saying why (`register_error`); the operator copies them into status.registered and a condition
(`read_registered_message`, `read_register_error_message`).
"""

from __future__ import annotations

import json
from typing import Any

TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath
VERDICT_KEYS = ("metric", "passed", "base", "tuned", "threshold", "rule", "reason")
MESSAGE_BYTES = 4096  # what Kubernetes keeps of a termination message
REGISTRIES = ("mlflow", "kubeflow")  # `kubetune export --register`, spec.export.register
REGISTERED_KEYS = ("registry", "name", "version", "uri")
TEXT_CHARS = 1000  # a URI or an error line longer than this is cut (the verdict and the rest must fit)


def line(result: dict[str, Any]) -> str:
    """gate: PASS perplexity 20.0000 -> 15.0000 (tuned <= base)"""
    word = "PASS" if result.get("passed") else "FAIL"
    base, tuned = _fmt(result.get("base")), _fmt(result.get("tuned"))
    against = f", threshold {result['threshold']:g}" if result.get("threshold") is not None else ""
    why = f"; {result['reason']}" if result.get("reason") else ""
    return f"gate: {word} {result.get('metric')} {base} -> {tuned} ({result.get('rule')}{against}){why}"


def gate_message(
    result: dict[str, Any] | None,
    lm_eval: dict[str, Any] | None = None,
    registered: dict[str, Any] | None = None,
    register_error: str | None = None,
) -> str:
    """The termination message of the export Job: one JSON object with the verdict, the
    lm-eval table (rounded to 4 places; left out where it would not fit Kubernetes' 4 KiB) and
    the registration's outcome (the model registered, or why not)."""
    out: dict[str, Any] = {}
    if result is not None:
        out["gate"] = {k: result.get(k) for k in VERDICT_KEYS}
    if registered is not None:
        out["registered"] = {k: _clip(registered[k]) for k in REGISTERED_KEYS if registered.get(k) is not None}
    if register_error is not None:
        out["register_error"] = _clip(register_error)
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


def read_registered_message(message: str | None) -> dict[str, str] | None:
    """The model the export Job registered ({registry, name, version[, uri]}), or None."""
    found = _message(message).get("registered")
    if not isinstance(found, dict) or not all(isinstance(found.get(k), str) for k in ("registry", "name", "version")):
        return None
    return {k: str(found[k]) for k in REGISTERED_KEYS if found.get(k) is not None}


def read_register_error_message(message: str | None) -> str | None:
    """Why the export Job's registration failed (one line), or None."""
    error = _message(message).get("register_error")
    return error if isinstance(error, str) and error else None


def _clip(x: Any) -> Any:
    return x[: TEXT_CHARS - 3] + "..." if isinstance(x, str) and len(x) > TEXT_CHARS else x


def _rounded(x: Any) -> Any:
    return round(x, 4) if isinstance(x, float) else x


def _fmt(x: Any) -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x:.4f}"
