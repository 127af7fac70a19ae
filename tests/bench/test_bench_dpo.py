"""The DPO benchmarks' plans, recipes and figures (bench/train/dpo_vs_trl.py, dpo_quality.py):
a recipe key renamed, a refused value or a verdict computed wrong fails here, not after an
hour of benchmark. The long runs themselves are not run here."""

from __future__ import annotations

import argparse
import json

import pytest

from kubetune.recipe import load_recipe
from tests.conftest import load_bench

vs_trl = load_bench("train/dpo_vs_trl")
quality = load_bench("train/dpo_quality")


def trl_args(**changes) -> argparse.Namespace:
    args = {"quick": False, "steps": 40, "rounds": 3, "skip": 3, "pairs_per_step": 4, "threads": 2}
    args |= {"precision": "auto", "arms": "trl,kubetune"}
    return argparse.Namespace(**(args | changes))


def test_quick_is_a_few_steps_and_kubetune_runs_first():
    plan = vs_trl.plan_from_args(trl_args(quick=True))
    assert (plan.steps, plan.rounds, plan.skip) == (4, 1, 1)
    assert plan.arms == ("kubetune", "trl")  # its precision choice is TRL's precision
    assert vs_trl.plan_from_args(trl_args()).pairs == 160


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"skip": 0}, "--skip must be >= 1"),
        ({"steps": 3}, "--steps 3 leaves no steady-state step"),
        ({"arms": "trl,hf"}, "--arms: unknown hf"),
        ({"arms": "trl"}, "--precision auto is kubetune's choice"),
    ],
)
def test_plans_that_cannot_measure_are_refused(changes, message):
    with pytest.raises(SystemExit, match=message):
        vs_trl.plan_from_args(trl_args(**changes))


def test_kubetune_side_loads_as_the_same_dpo_run(tmp_path):
    plan = vs_trl.plan_from_args(trl_args())
    recipe = load_recipe(None, vs_trl.kubetune_overrides(plan, tmp_path / "pairs.jsonl", str(tmp_path), "auto")).recipe
    assert (recipe.finetune.objective, recipe.finetune.beta) == ("dpo", vs_trl.BETA)
    # one pair per unpacked row, pairs_per_step rows a step: TRL's steps
    assert (recipe.data.packing, recipe.train.micro_batch_size, recipe.train.grad_accum) == (False, 4, 1)
    assert (recipe.train.max_steps, recipe.train.lr_schedule, recipe.train.warmup_steps) == (40, "constant", 0)
    assert (recipe.lora.r, recipe.lora.dropout, recipe.lora.target_modules) == (8, 0.0, vs_trl.LORA["targets"])


def test_flashcard_pairs_reject_the_next_cards_answer(tmp_path):
    cards = tmp_path / "train.jsonl"
    rows = [{"instruction": "Q", "input": f"q{i}", "output": f"a{i}"} for i in range(3)]
    rows.insert(1, {"instruction": "Q", "input": "no answer", "output": " "})  # train.jsonl has such cards
    cards.write_text("".join(json.dumps(row) + "\n" for row in rows))
    pairs = vs_trl.flashcard_pairs(2, cards)
    assert [(p["input"], p["chosen"], p["rejected"]) for p in pairs] == [("q0", "a0", "a1"), ("q1", "a1", "a2")]
    with pytest.raises(SystemExit, match="3 rows with an answer; 4 are needed"):
        vs_trl.flashcard_pairs(3, cards)


def test_pairs_per_s_leaves_out_start_up_and_counts_a_precomputed_reference():
    plan = vs_trl.Plan(steps=4, pairs_per_step=2, rounds=1, skip=1, threads=1, precision="fp32", arms=())
    on_the_fly = {"step_s": [9.0, 1.0, 1.0, 3.0], "reference_s": 0.0}
    assert vs_trl.pairs_per_s(on_the_fly, plan) == pytest.approx(8 / 4.0)  # median 1 s x 4 steps
    precomputed = on_the_fly | {"reference_s": 4.0}
    assert vs_trl.pairs_per_s(precomputed, plan) == pytest.approx(8 / 8.0)


def test_curves_agree_within_twice_trls_seed_to_seed_noise_or_the_floor():
    def run(loss, acc):
        return {"curves": {"loss": loss, "rewards/accuracies": acc}}

    trl = run([0.693, 0.68, 0.60], [0.0, 0.5, 1.0])
    noise = run([0.693, 0.66, 0.62], [0.0, 0.5, 0.75])  # loss noise 0.02, accuracy 0.25
    close = vs_trl.curve_verdicts(run([0.693, 0.64, 0.62], [0.0, 0.25, 0.5]), trl, noise)
    assert close["loss"]["ok"] and close["rewards/accuracies"]["ok"]
    assert close["loss"]["bound"] == pytest.approx(0.04)
    far = vs_trl.curve_verdicts(run([0.693, 0.50, 0.62], [0.0, 0.5, 0.0]), trl, noise)
    assert not far["loss"]["ok"] and not far["rewards/accuracies"]["ok"]
    same_seedless = vs_trl.curve_verdicts(run([0.693, 0.685, 0.60], [0.0, 0.5, 1.0]), trl, trl)
    assert same_seedless["loss"]["bound"] == vs_trl.NOISE_FLOOR["loss"] and same_seedless["loss"]["ok"]
    assert not vs_trl.curve_verdicts(trl, trl, None)["loss"]["ok"]  # no noise run: nothing is judged to agree


def test_a_token_mismatch_is_named():
    ours = [([1, 2], [3, 0], [4, 0])]
    assert (
        vs_trl.first_token_mismatch([{"prompt_ids": [1, 2], "chosen_ids": [3, 0], "rejected_ids": [4, 0]}], ours)
        is None
    )
    mismatch = vs_trl.first_token_mismatch([{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 0]}], ours)
    assert mismatch.startswith("pair 0 chosen_ids")
    assert vs_trl.first_token_mismatch([], ours) == "TRL kept 0 of the 1 pairs"


@pytest.mark.slow
def test_trl_tokenizes_the_pairs_as_kubetune_in_its_step_order(tmp_path, tiny_model_dir, tokenizer):
    from trl import DPOTrainer

    cards = tmp_path / "train.jsonl"
    cards.write_text(
        "".join(
            json.dumps({"instruction": "Answer this question truthfully", "input": f"What is {i}?", "output": f"{i}."})
            + "\n"
            for i in range(7)
        )
    )
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps(r) + "\n" for r in vs_trl.flashcard_pairs(6, cards)))
    plan = vs_trl.Plan(steps=3, pairs_per_step=2, rounds=1, skip=1, threads=1, precision="fp32", arms=())
    order, data = vs_trl.kubetune_steps(plan, pairs_file, str(tmp_path))
    assert sorted(order) == list(range(6))
    trainer = DPOTrainer(
        model=vs_trl.trl_lora_model(str(tiny_model_dir), vs_trl.SEED),
        args=vs_trl.trl_config(plan, str(tmp_path / "trl"), "fp32", False, vs_trl.SEED),
        train_dataset=vs_trl.trl_dataset(vs_trl.read_jsonl(pairs_file), order, data.renderer),
        processing_class=tokenizer,
    )
    ours = [vs_trl.pair_tokens(data.train, i) for i in order]
    assert vs_trl.first_token_mismatch(trainer.train_dataset, ours) is None
    assert all(chosen[-1] == tokenizer.eos_token_id for _, chosen, _ in ours)
    ours[1] = (ours[1][0], ours[1][1][:-1], ours[1][2])  # kubetune without its EOS would differ
    assert vs_trl.first_token_mismatch(trainer.train_dataset, ours).startswith("pair 1 chosen_ids")


def test_quality_commands_are_the_recipes_own(tmp_path):
    plan = quality.plan_from_args(argparse.Namespace(quick=True, limit=None, pairs=None, out=tmp_path))
    assert plan.limit == 24 and plan.max_steps == 2
    make = quality.make_pairs_command(plan)
    assert make[:3] == ["data", "make-preferences", quality.RECIPE] and make[-2:] == ["--limit", "24"]
    train = quality.train_command(plan)
    assert train[:2] == ["train", quality.RECIPE]
    recipe = load_recipe(train[1], train[2:]).recipe
    assert recipe.finetune.objective == "dpo" and recipe.data.train == str(tmp_path / "pairs.jsonl")
    assert recipe.data.eval == 0.1 and recipe.train.max_steps == 2  # held-out pairs: where both figures come from
    with pytest.raises(SystemExit, match="no such file"):
        quality.plan_from_args(argparse.Namespace(quick=False, limit=None, pairs=tmp_path / "none.jsonl", out=tmp_path))


@pytest.mark.parametrize(
    ("accuracy", "after", "accuracy_ok", "perplexity_ok"),
    [(0.8, 10.5, True, True), (0.79, 10.0, False, True), (0.9, 10.51, True, False)],
)
def test_quality_targets(accuracy, after, accuracy_ok, perplexity_ok):
    summary = {
        "reward_accuracy_before": 0.0,
        "reward_accuracy_after": accuracy,
        "perplexity_before": 10.0,
        "perplexity_after": after,
    }
    v = quality.verdicts(summary)
    assert (v["accuracy_ok"], v["perplexity_ok"]) == (accuracy_ok, perplexity_ok)


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_quality_counts_the_pairs_the_run_holds_out(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"instruction": "Q", "input": f"q{i}", "chosen": f"right {i}", "rejected": f"wrong {i}"} for i in range(20)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = quality.plan_from_args(argparse.Namespace(quick=False, limit=None, pairs=pairs, out=tmp_path))
    assert quality.held_out_pairs(plan, tmp_path / "cache") == 2  # the recipe's data.eval: 0.1, whole pairs


def test_report_compares_kubetune_with_trls_faster_setting(capsys):
    plan = vs_trl.Plan(steps=4, pairs_per_step=2, rounds=1, skip=1, threads=2, precision="auto", arms=())
    curves = {"loss": [0.693, 0.68, 0.67, 0.66], "rewards/accuracies": [0.0, 0.5, 1.0, 1.0]}

    def run(step_s, rss, reference_s=0.0, **extra):
        return {"curves": curves, "step_s": step_s, "reference_s": reference_s, "peak_rss_mb": rss} | extra

    trl = {"pairs_checked": 8, "precision": "fp32"}
    results = {
        "kubetune": [run([float("nan"), 1.0, 1.0, 1.0], 1000.0, precision="fp32", processes="processes: 2 x 1")],
        "kubetune-1proc": [run([float("nan"), 2.0, 2.0, 2.0], 700.0, precision="fp32")],
        "trl": [run([5.0, 4.0, 4.0, 4.0], 2000.0, **trl)],  # 0.5 pairs/s
        "trl-precompute": [run([5.0, 3.0, 3.0, 3.0], 2100.0, reference_s=8.0, **trl)],  # 8 / 20 s = 0.4
        "noise": [run([5.0, 4.0, 4.0, 4.0], 2000.0, **trl)],
    }
    vs_trl.report(plan, results, "test pairs")
    out = capsys.readouterr().out
    assert "TRL's faster CPU setting here: trl (precompute_ref_log_probs=False)" in out
    # kubetune 2 pairs/s vs TRL's 0.5: x4; 1000 MB vs 2000: x0.5
    assert "pairs/s x4.00 (target >= 2.0: PASS), peak RSS x0.50 (target <= 0.6: PASS)" in out
    assert "curves within run-to-run noise: PASS" in out
    assert "kubetune-1proc / TRL (trl): pairs/s x2.00, peak RSS x0.35" in out
    assert json.loads(out.strip().splitlines()[-1])["trl_arm"] == "trl"
