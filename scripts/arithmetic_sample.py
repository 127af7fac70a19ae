"""Write kubetune's bundled verifiable task for GRPO: short arithmetic questions with their answers.

    .venv/bin/python scripts/arithmetic_sample.py            # write the two files
    .venv/bin/python scripts/arithmetic_sample.py --check    # exit 1, naming each file that differs

Writes src/kubetune/data/samples/arithmetic_train.jsonl and arithmetic_heldout.jsonl
(`builtin:arithmetic_train`, `builtin:arithmetic_heldout`): prompt-only rows, TRL's `prompt` column
with an `answer` column for the `accuracy` reward and the `skill` the question exercises. Every
question of each skill is listed, shuffled with a fixed seed and split before any is repeated, so
the held-out questions never appear in training and the files are the same on every run (Python's
`random.Random` with an integer seed gives the same sequence on every platform and version). The
choice of skills and what the base model scores on them: the samples' README.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

SAMPLES = Path(__file__).resolve().parents[1] / "src" / "kubetune" / "data" / "samples"
NAME = "arithmetic"
SEED = 36
HELD_OUT = 200
TRAIN = 2000
INSTRUCTION = "Answer with only the number."

Row = dict[str, str]


def _row(skill: str, question: str, answer: int) -> Row:
    return {"prompt": f"{question} {INSTRUCTION}", "answer": str(answer), "skill": skill}


# Each skill has at least 100 questions, so that 50 are held out and the rest still train it.
def addition() -> Iterator[Row]:
    for a in range(1, 11):
        for b in range(1, 11):
            yield _row("addition", f"What is {a} + {b}?", a + b)


def subtraction() -> Iterator[Row]:
    for a in range(1, 17):
        for b in range(1, min(a, 9) + 1):
            yield _row("subtraction", f"What is {a} - {b}?", a - b)


def successor() -> Iterator[Row]:
    for a in range(10, 1000):
        yield _row("successor", f"What number comes right after {a}?", a + 1)


def times_ten() -> Iterator[Row]:
    for a in range(2, 151):
        yield _row("times_ten", f"What is {a} times 10?", a * 10)


SKILLS: tuple[Callable[[], Iterator[Row]], ...] = (addition, subtraction, successor, times_ten)


def split(seed: int = SEED) -> tuple[list[Row], list[Row]]:
    """(train, held-out): the skills in equal shares, each skill's questions shuffled and the first
    ones held out; a skill with fewer questions than its training share repeats them in training."""
    rng = random.Random(seed)
    train: list[Row] = []
    held_out: list[Row] = []
    for skill in SKILLS:
        questions = list(skill())
        rng.shuffle(questions)
        held = HELD_OUT // len(SKILLS)
        held_out += questions[:held]
        rest = questions[held:]
        train += [rest[i % len(rest)] for i in range(TRAIN // len(SKILLS))]
    rng.shuffle(train)
    rng.shuffle(held_out)
    return train, held_out


def jsonl(rows: list[Row]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def expected() -> dict[Path, str]:
    train, held_out = split()
    return {SAMPLES / f"{NAME}_train.jsonl": jsonl(train), SAMPLES / f"{NAME}_heldout.jsonl": jsonl(held_out)}


def main(argv: list[str]) -> int:
    files = expected()
    stale = [path for path, text in files.items() if not path.is_file() or path.read_text(encoding="utf-8") != text]
    if "--check" in argv:
        for path in stale:
            print(f"{path} differs from what scripts/arithmetic_sample.py writes; run it to regenerate")
        return 1 if stale else 0
    for path in stale:
        path.write_text(files[path], encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
