"""The eval gate (`eval.gate`): whether the tuned model may be served, from summary.json's numbers.

One metric, the tuned model's value against the base model's (compare: base) or a fixed value
(compare: threshold), with a tolerance in the metric's units: with higher_is_better the tuned
value passes when it is at least reference - tolerance, otherwise when it is at most
reference + tolerance. A metric the run has no number for fails, saying so. `kubetune train`
prints the verdict and writes it into summary.json as `gate`; its exit status stays 0 (the model
was trained and saved; serving it is the operator's decision, docs/evaluation.md).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from kubetune.contracts.gate import TERMINATION_LOG, gate_message, line
from kubetune.recipe.schema import GateSection
from kubetune.rundir import RunDir

__all__ = ["check_before_export", "line", "tell_operator", "verdict"]

# summary.json's before/after keys of the gate's own metric names
SUMMARY_KEYS = {
    "perplexity": ("perplexity_before", "perplexity_after"),
    "eval_loss": ("eval_loss_before", "eval_loss_after"),
    "eval_reward": ("reward_before", "reward_after"),
    "reward_accuracy": ("reward_accuracy_before", "reward_accuracy_after"),
}


def base_and_tuned(gate: GateSection, summary: dict[str, Any]) -> tuple[float | None, float | None]:
    if gate.task is not None:
        metric = gate.metric.split("/", 1)[1]
        pair = summary.get("lm_eval", {}).get(gate.task, {}).get(metric, {})
        return pair.get("base"), pair.get("tuned")
    before, after = SUMMARY_KEYS[gate.metric]
    return summary.get(before), summary.get(after)


def verdict(gate: GateSection, summary: dict[str, Any]) -> dict[str, Any]:
    """summary.json's `gate`: passed, the numbers and the rule in words."""
    base, tuned = base_and_tuned(gate, summary)
    reference = gate.threshold if gate.compare == "threshold" else base
    sign = ">=" if gate.higher else "<="
    bound = None if reference is None else reference - gate.tolerance if gate.higher else reference + gate.tolerance
    named = "threshold" if gate.compare == "threshold" else "base"
    rule = f"tuned {sign} {named}" + (f" {'-' if gate.higher else '+'} {gate.tolerance:g}" if gate.tolerance else "")
    if tuned is None or bound is None:
        missing = "tuned" if tuned is None else "base"
        return {"metric": gate.metric, "passed": False, "base": base, "tuned": tuned, "threshold": gate.threshold,
                "rule": rule, "reason": f"summary.json has no {missing} value of {gate.metric}"}  # fmt: skip
    passed = tuned >= bound if gate.higher else tuned <= bound
    return {"metric": gate.metric, "passed": passed, "base": base, "tuned": tuned, "threshold": gate.threshold,
            "rule": rule, "reason": None}  # fmt: skip


def check_before_export(run_dir: Path) -> bool:
    """`kubetune export RUN --gate`: whether the run's gate passed (True without a gate). The
    verdict (summary.json's, written by training) is printed; it and the lm-eval results are
    written as the termination message (`tell_operator`), for the operator to read."""
    result = _run_verdict(RunDir(run_dir))[0]
    if result is not None:
        print(line(result))
    tell_operator(run_dir)
    return result is None or bool(result["passed"])


def tell_operator(run_dir: Path, registered: dict[str, Any] | None = None, register_error: str | None = None) -> None:
    """The termination message (contracts/gate.py): the gate's verdict and lm-eval's results of
    the run, and what `--register` registered (or why not); written in a pod (where Kubernetes
    made /dev/termination-log) or to KUBETUNE_TERMINATION_LOG, never elsewhere; nothing to say,
    nothing written."""
    target = os.environ.get("KUBETUNE_TERMINATION_LOG") or (TERMINATION_LOG if Path(TERMINATION_LOG).exists() else None)
    result, lm_eval = _run_verdict(RunDir(run_dir))
    if target is None or (result is None and not lm_eval and registered is None and register_error is None):
        return
    with contextlib.suppress(OSError):  # not writable: the printed lines say it all
        Path(target).write_text(gate_message(result, lm_eval, registered, register_error))


def _run_verdict(run: RunDir) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The run's gate verdict (summary.json's, or worked out from its numbers) and lm-eval table."""
    summary = json.loads(run.summary_file.read_text()) if run.summary_file.is_file() else {}
    gate = run.recipe().eval.gate
    result = None if gate is None else summary.get("gate") or verdict(gate, summary)
    return result, summary.get("lm_eval") or None
