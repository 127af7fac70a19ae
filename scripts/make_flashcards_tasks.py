"""Write the data of kubetune's lm-eval tasks (src/kubetune/data/lm_tasks/flashcards_heldout.jsonl)
from the bundled flashcards sample: its held-out rows only, the very rows the Quick start's
`data.eval: 0.1` keeps out of training (kubetune.data.split_rows, its fixed seed), so no
question a run trained on is ever asked. Each row keeps instruction/input/output and adds the
multiple-choice variant's four `choices` (its own answer and the answers of 3 other held-out
cards, drawn with a fixed seed) and `label` (where its own answer is). Deterministic:
`--check` compares the file with what it would write (tests run it).

    python scripts/make_flashcards_tasks.py [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from kubetune.data import split_rows
from kubetune.data.sources import load_rows

HELD_OUT = 0.1  # the Quick start recipe's data.eval (src/kubetune/recipes/smollm2-135m-lora-cpu.yaml)
CHOICES_SEED = 38
OUT = Path(__file__).resolve().parents[1] / "src/kubetune/data/lm_tasks/flashcards_heldout.jsonl"


def rows() -> list[dict]:
    sample = load_rows("builtin:medical_flashcards_sample", "train", "data.train")
    _, held = split_rows(sample, HELD_OUT)
    rng = np.random.default_rng(CHOICES_SEED)
    out = []
    for i, row in enumerate(held):
        others = [j for j in range(len(held)) if j != i]
        distractors = [held[j]["output"] for j in rng.choice(others, size=3, replace=False)]
        label = int(rng.integers(4))
        choices = distractors[:label] + [row["output"]] + distractors[label:]
        out.append({**{k: row[k] for k in ("instruction", "input", "output")}, "choices": choices, "label": label})
    return out


def text() -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    if parser.parse_args().check:
        same = OUT.read_text() == text()
        print(f"{OUT}: {'up to date' if same else 'differs: run scripts/make_flashcards_tasks.py'}")
        return 0 if same else 1
    OUT.write_text(text())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
