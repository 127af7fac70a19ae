"""The bundled GRPO task (`builtin:arithmetic_train`, `builtin:arithmetic_heldout`): the files are what
scripts/arithmetic_sample.py writes, the held-out questions never appear in training, the skills
come in equal shares, and every answer is right and scored 1.0 by the `accuracy` reward."""

from __future__ import annotations

import operator
import re
import runpy
import sys

import pytest

from kubetune.data.sources import load_rows
from kubetune.training.rewards import build_rewards, score
from tests.kit.paths import REPO

SCRIPT = REPO / "scripts" / "arithmetic_sample.py"
QUESTION = re.compile(r"What is (\d+) ([-+]) (\d+)\?|What number comes right after (\d+)\?|What is (\d+) times 10\?")


@pytest.fixture(scope="module")
def shipped():
    return load_rows("builtin:arithmetic_train", "train", "data.train"), load_rows(
        "builtin:arithmetic_heldout", "train", "data.eval"
    )


def test_the_shipped_files_are_what_the_script_writes(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["arithmetic_sample.py", "--check"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert e.value.code == 0, capsys.readouterr().out


def test_the_split_is_the_same_for_the_same_seed_and_changes_with_it():
    script = runpy.run_path(str(SCRIPT))
    assert script["split"]() == script["split"]()
    assert script["split"](seed=1)[1] != script["split"]()[1]


def test_held_out_questions_never_appear_in_training_and_skills_are_equal_shares(shipped):
    train, held_out = shipped
    assert (len(train), len(held_out)) == (2000, 200)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert len({r["prompt"] for r in held_out}) == len(held_out)
    for rows, share in ((train, 500), (held_out, 50)):
        skills = [r["skill"] for r in rows]
        assert {s: skills.count(s) for s in set(skills)} == dict.fromkeys(
            ("addition", "subtraction", "successor", "times_ten"), share
        )


def test_every_answer_is_right_and_the_accuracy_reward_gives_it_full_marks(shipped):
    rows = [r for split in shipped for r in split]
    for row in rows:
        assert row["answer"] == str(_solve(row["prompt"])), row
    (accuracy,) = build_rewards(["accuracy"])
    answers = [r["answer"] for r in rows]
    scores = score([accuracy], [r["prompt"] for r in rows], answers, {"answer": answers})
    assert set(scores.total) == {1.0}


def _solve(prompt: str) -> int:
    match = QUESTION.match(prompt)
    assert match and prompt.endswith(" Answer with only the number."), prompt
    a, op, b, after, tens = match.groups()
    if after:
        return int(after) + 1
    if tens:
        return int(tens) * 10
    return {"+": operator.add, "-": operator.sub}[op](int(a), int(b))
