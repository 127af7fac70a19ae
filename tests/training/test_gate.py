"""The eval gate: its rule on summary.json's numbers, and `kubetune train` printing and recording
the verdict (pass and fail) with lm-eval tasks run on the base and the tuned model."""

from __future__ import annotations

import json

import pytest

from kubetune.contracts.gate import read_gate_message
from kubetune.errors import RecipeError
from kubetune.export import adapter_install, gate
from kubetune.recipe import load_recipe
from kubetune.recipe.schema import GateSection

SUMMARY = {
    "perplexity_before": 20.0,
    "perplexity_after": 15.0,
    "lm_eval": {"flashcards": {"rougeL": {"base": 0.30, "tuned": 0.28}}},
}


@pytest.mark.parametrize(
    ("rule", "passed"),
    [
        ({"metric": "perplexity"}, True),  # lower is better: 15 <= 20
        ({"metric": "perplexity", "compare": "threshold", "threshold": 10.0}, False),
        ({"metric": "perplexity", "compare": "threshold", "threshold": 10.0, "tolerance": 5.0}, True),
        ({"metric": "flashcards/rougeL"}, False),  # higher is better: 0.28 < 0.30
        ({"metric": "flashcards/rougeL", "tolerance": 0.05}, True),
        ({"metric": "flashcards/rougeL", "higher_is_better": False}, True),
        ({"metric": "eval_reward"}, False),  # no number: fails, saying so
    ],
)
def test_rule(rule, passed):
    result = gate.verdict(GateSection(**rule), SUMMARY)
    assert result["passed"] is passed
    assert gate.line(result).startswith(f"gate: {'PASS' if passed else 'FAIL'} {rule['metric']}")


def test_missing_number_says_which():
    result = gate.verdict(GateSection(metric="eval_reward"), SUMMARY)
    assert gate.line(result).endswith("; summary.json has no tuned value of eval_reward")


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["eval.gate={metric: perplexity, compare: threshold}"], "needs eval.gate.threshold"),
        (["eval.gate={metric: accuracy}"], "eval.gate.metric=accuracy"),
        (["eval.gate={metric: flashcards/rougeL}"], "add flashcards to eval.tasks"),
    ],
)
def test_bad_gate_is_a_recipe_error(overrides, says):
    with pytest.raises(RecipeError, match=says):
        load_recipe(None, overrides)


def test_gate_keys_keep_old_runs_fingerprints():
    from kubetune.rundir import fingerprint

    plain = load_recipe(None, []).recipe
    gated = load_recipe(None, ["eval.tasks=[flashcards]", "eval.gate={metric: flashcards/rougeL}"]).recipe
    assert fingerprint(plain) == fingerprint(gated)


@pytest.mark.parametrize(
    ("rule", "word"),
    [
        pytest.param("{metric: perplexity, tolerance: 1000000}", "PASS", marks=pytest.mark.slow),
        ("{metric: flashcards_mc/acc, compare: threshold, threshold: 1.01}", "FAIL"),
    ],
)
def test_train_prints_and_records_the_verdict(tmp_path, tiny_overrides, capfd, monkeypatch, rule, word):
    """... and the operator's export Job (`export --gate`) exports only a run that passed, and
    writes the verdict as its termination message."""
    from tests.kit.cli import run_cli_in_process

    out = tmp_path / "run"
    args = [
        "train",
        *tiny_overrides,
        "train.max_steps=2",
        "eval.generate=0",
        "eval.tasks=[flashcards_mc]",
        "eval.tasks_limit=2",
        f"eval.gate={rule}",
        f"output_dir={out}",
    ]
    done = run_cli_in_process(args, capfd)
    assert done.returncode == 0, done.stderr[-3000:]  # a failed gate: the run was still trained and saved
    gate_lines = [ln for ln in done.stdout.splitlines() if ln.startswith("gate: ")]
    assert len(gate_lines) == 1 and gate_lines[0].startswith(f"gate: {word}"), done.stdout[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gate"]["passed"] is (word == "PASS")
    assert set(summary["lm_eval"]["flashcards_mc"]["acc"]) == {"base", "tuned"}
    message = tmp_path / "termination-log"
    monkeypatch.setenv("KUBETUNE_TERMINATION_LOG", str(message))
    exported = run_cli_in_process(["export", str(out), "--merged", "--gate"], capfd)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert exported.stdout.startswith(f"gate: {word}")
    assert read_gate_message(message.read_text())["passed"] is (word == "PASS")
    assert (out / "merged").is_dir() is (word == "PASS")
    # a shared server's adapter-export Job: a failed gate installs and registers nothing
    root = tmp_path / "adapters"
    install = [str(out), "--name", "cardio", "--version", "v1", "--base", "org/base", "--root", str(root), "--gate"]
    assert adapter_install.main(install) == 0
    assert (root / "registry.json").is_file() is (word == "PASS")
    assert (root / "cardio" / "v1").is_dir() is (word == "PASS")


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_an_unknown_eval_task_stops_before_training(tmp_path, tiny_overrides, capfd):
    from tests.kit.cli import run_cli_in_process

    out = tmp_path / "run"
    done = run_cli_in_process(["train", *tiny_overrides, "eval.tasks=[no_such_task_xyz]", f"output_dir={out}"], capfd)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("kubetune: error")]
    assert done.returncode == 2 and len(errors) == 1 and "eval.tasks no_such_task_xyz: not an lm-eval task" in errors[0]
    assert not (out / "checkpoints").exists()
