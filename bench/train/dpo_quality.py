"""DPO quality after one epoch of the shipped recipe on the bundled flashcard pairs.

The two commands `recipes/smollm2-135m-dpo-cpu.yaml` opens with, as a user runs them:
`kubetune data make-preferences` on `builtin:medical_flashcards_sample` with the base model
(chosen = the card's reference answer, rejected = the base model's own greedy answer), then
one epoch of `kubetune train smollm2-135m-dpo-cpu` on those pairs. The recipe holds a tenth
of the pairs out (`data.eval: 0.1`, whole pairs, never trained on); its evaluation before and
after training gives both figures of issue 28's second target, on those held-out pairs:
  - reward accuracy (TRL's `eval_rewards/accuracies`: the share of pairs whose chosen answer
    earns the higher DPO reward) after the epoch: target >= 0.8;
  - the SFT perplexity of their reference (chosen) answers, before vs after DPO: no worse
    than +5%.
Printed with PASS/MISS; the pairs and the run stay in runs/bench-dpo-quality/.

    .venv/bin/python bench/train/dpo_quality.py                   # make the pairs, then one epoch
    .venv/bin/python bench/train/dpo_quality.py --pairs runs/bench-dpo-quality/pairs.jsonl
    .venv/bin/python bench/train/dpo_quality.py --quick           # smoke run: 24 pairs, 2 steps
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = "smollm2-135m-dpo-cpu"
DATA = "builtin:medical_flashcards_sample"
OUT = REPO / "runs" / "bench-dpo-quality"
# issue 28's targets: held-out reward accuracy at least this, perplexity at most this times the base's
ACCURACY_TARGET, PERPLEXITY_TARGET = 0.8, 1.05


@dataclass(frozen=True)
class Plan:
    pairs: Path | None  # made pairs to reuse; None = make them
    limit: int | None  # flashcards to make pairs of (None: all)
    max_steps: int | None  # None: the recipe's one epoch
    out: Path

    @property
    def pairs_file(self) -> Path:
        return self.pairs or self.out / "pairs.jsonl"


def plan_from_args(args: argparse.Namespace) -> Plan:
    limit, steps = (24, 2) if args.quick else (args.limit, None)
    if args.pairs and not args.pairs.is_file():
        raise SystemExit(f"--pairs {args.pairs}: no such file; leave --pairs out to make the pairs")
    return Plan(args.pairs, limit, steps, args.out)


def make_pairs_command(plan: Plan) -> list[str]:
    cmd = ["make-preferences", RECIPE, f"data.train={DATA}", "--out", str(plan.pairs_file)]
    return ["data", *cmd] + (["--limit", str(plan.limit)] if plan.limit else [])


def train_command(plan: Plan) -> list[str]:
    overrides = [f"data.train={plan.pairs_file}", f"output_dir={plan.out / 'run'}"]
    return ["train", RECIPE, *overrides] + ([f"train.max_steps={plan.max_steps}"] if plan.max_steps else [])


def kubetune(args: list[str]) -> tuple[str, float]:
    """Run `kubetune ARGS` as a user would; its stdout and its wall time."""
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "kubetune", *args], capture_output=True, text=True, env=os.environ)
    if res.returncode != 0:
        raise SystemExit(f"kubetune {' '.join(args)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return res.stdout, time.perf_counter() - t


def held_out_pairs(plan: Plan, cache_dir: Path | None = None) -> int:
    """How many pairs the run held out, as its own data code splits them (the tokenized pairs
    cached where the run caches them, or in `cache_dir`)."""
    from kubetune.data import prepare_data
    from kubetune.models.load import load_tokenizer, resolve_model
    from kubetune.recipe import load_recipe

    train = train_command(plan)
    recipe = load_recipe(train[1], train[2:] + ([f"data.cache_dir={cache_dir}"] if cache_dir else [])).recipe
    data = prepare_data(recipe, load_tokenizer(resolve_model(recipe.model.name_or_path)))
    return len(data.eval) if data.eval is not None else 0


def verdicts(summary: dict) -> dict:
    """The two targets on the held-out pairs, from the run's summary.json."""
    accuracy = summary["reward_accuracy_after"]
    before, after = summary["perplexity_before"], summary["perplexity_after"]
    return {
        "reward_accuracy_before": summary["reward_accuracy_before"],
        "reward_accuracy": accuracy,
        "accuracy_ok": accuracy >= ACCURACY_TARGET,
        "perplexity_before": before,
        "perplexity_after": after,
        "perplexity_ratio": after / before,
        "perplexity_ok": after <= PERPLEXITY_TARGET * before,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=Path, help="pairs make-preferences wrote before (default: make them)")
    p.add_argument("--limit", type=int, help="make pairs of the first N flashcards only")
    p.add_argument("--out", type=Path, default=OUT, help="where the pairs and the run go")
    p.add_argument("--quick", action="store_true", help="smoke run: pairs of 24 cards, 2 training steps")
    plan = plan_from_args(p.parse_args())
    shutil.rmtree(plan.out / "run", ignore_errors=True)
    plan.out.mkdir(parents=True, exist_ok=True)
    made_s = 0.0
    if plan.pairs is None:
        made, made_s = kubetune(make_pairs_command(plan))
        print(f"make-preferences: {made.strip()}")
    _, train_s = kubetune(train_command(plan))
    summary = json.loads((plan.out / "run" / "summary.json").read_text())
    v = verdicts(summary)
    pairs = sum(1 for line in plan.pairs_file.read_text().splitlines() if line.strip())
    held_out = held_out_pairs(plan)
    print(
        f"pairs: {pairs} in {plan.pairs_file} (made in {made_s:.0f} s), {held_out} of them held out; "
        f"training: {summary['steps']} steps, {train_s:.0f} s"
    )
    if plan.max_steps:
        print(f"(a smoke run: {summary['steps']} steps, figures on {held_out} pairs say nothing of the target)")
    print(
        f"held-out reward accuracy {v['reward_accuracy_before']:.3f} -> {v['reward_accuracy']:.3f} "
        f"(target >= {ACCURACY_TARGET}: {'PASS' if v['accuracy_ok'] else 'MISS'})"
    )
    print(
        f"held-out perplexity of the reference answers {v['perplexity_before']:.3f} -> {v['perplexity_after']:.3f} "
        f"(x{v['perplexity_ratio']:.3f}; target <= x{PERPLEXITY_TARGET}: {'PASS' if v['perplexity_ok'] else 'MISS'})"
    )
    print(
        json.dumps(
            v | {"pairs": pairs, "held_out": held_out, "steps": summary["steps"], "make_s": made_s, "train_s": train_s}
        )
    )


if __name__ == "__main__":
    main()
