"""The eval gate (`eval.gate`): whether the tuned model may be served, from summary.json's numbers.

One metric, the tuned model's value against the base model's (compare: base) or a fixed value
(compare: threshold), with a tolerance in the metric's units: with higher_is_better the tuned
value passes when it is at least reference - tolerance, otherwise when it is at most
reference + tolerance. A metric the run has no number for fails, saying so. `kubetune train`
prints the verdict and writes it into summary.json as `gate`; its exit status stays 0 (the model
was trained and saved; serving it is the operator's decision, docs/evaluation.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubetune.contracts.gate import TERMINATION_LOG, gate_message, line
from kubetune.recipe.schema import GateSection
from kubetune.rundir import RunDir

__all__ = ["check_before_export", "line", "verdict"]

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
    written as the termination message where that file can be written (in a pod;
    KUBETUNE_TERMINATION_LOG elsewhere), for the operator to read."""
    import contextlib
    import json
    import os

    termination_log = Path(os.environ.get("KUBETUNE_TERMINATION_LOG", TERMINATION_LOG))
    run = RunDir(run_dir)
    recipe = run.recipe()
    summary = json.loads(run.summary_file.read_text()) if run.summary_file.is_file() else {}
    result = None
    if recipe.eval.gate is not None:
        result = summary.get("gate") or verdict(recipe.eval.gate, summary)
        print(line(result))
    if result is not None or summary.get("lm_eval"):
        with contextlib.suppress(OSError):  # not in a pod: the printed line is the verdict
            termination_log.write_text(gate_message(result, summary.get("lm_eval")))
    return result is None or bool(result["passed"])
