"""The shipped GRPO task: the files are what the script writes (deterministic), held-out questions
never appear in training, and every answer is its question's."""

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "src" / "kubetune" / "data" / "samples"


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (SAMPLES / f"arithmetic_{name}.jsonl").read_text().splitlines()]


def test_the_files_are_what_the_script_writes():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "make_arithmetic_task.py"), "--check"])
    assert done.returncode == 0


def test_held_out_questions_are_not_trained_on_and_answers_are_right():
    train, test = rows("train"), rows("test")
    assert (len(train), len(test)) == (2000, 200)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for r in train + test:
        q = r["prompt"]
        if m := re.match(r"What is (\d+) \+ (\d+)\?", q):
            expected = int(m[1]) + int(m[2])
        elif m := re.match(r"What is (\d+) - (\d+)\?", q):
            expected = int(m[1]) - int(m[2])
        elif m := re.match(r"What number comes right after (\d+)\?", q):
            expected = int(m[1]) + 1
        else:
            m = re.match(r"What is (\d+) times 10\?", q)
            assert m, q
            expected = int(m[1]) * 10
        assert r["answer"] == str(expected) and q.endswith("Answer with only the number.")
