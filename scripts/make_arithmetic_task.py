"""Write kubetune's small verifiable GRPO task: short arithmetic questions whose answer is a
number, asked to be given alone (`src/kubetune/data/samples/arithmetic_{train,test}.jsonl`).

Deterministic: the same files on every run (fixed seeds); a held-out question never appears in
the training file. Four kinds of question, mixed: a + b and a - b with numbers up to 20, the
number after n, and n times 10. SmolLM2-135M-Instruct knows most of the arithmetic but almost
never answers with the number alone (it explains), so the `accuracy` reward (the whole
completion must be the number) starts near 0 and rewards learning the asked-for form.

    python scripts/make_arithmetic_task.py          # rewrite the files
    python scripts/make_arithmetic_task.py --check  # exit 1 if they differ from what this writes
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SAMPLES = Path(__file__).resolve().parents[1] / "src" / "kubetune" / "data" / "samples"
SUFFIX = " Answer with only the number."
TRAIN_ROWS, TEST_ROWS = 2000, 200


def question(rng: random.Random) -> tuple[str, int]:
    kind = rng.choice(("add", "sub", "next", "times10"))
    if kind == "add":
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        return f"What is {a} + {b}?", a + b
    if kind == "sub":
        a = rng.randint(2, 20)
        b = rng.randint(1, a)
        return f"What is {a} - {b}?", a - b
    if kind == "next":
        n = rng.randint(10, 999)
        return f"What number comes right after {n}?", n + 1
    n = rng.randint(2, 99)
    return f"What is {n} times 10?", n * 10


def rows(seed: int, count: int, exclude: set[str]) -> list[dict[str, str]]:
    """`count` rows drawn with `seed`, none of whose questions is in `exclude` (a question may
    repeat within a split: the small sums are few)."""
    rng, out = random.Random(seed), []
    while len(out) < count:
        q, a = question(rng)
        if q not in exclude:
            out.append({"prompt": q + SUFFIX, "answer": str(a)})
    return out


def files() -> dict[Path, str]:
    test = rows(seed=2026, count=TEST_ROWS, exclude=set())
    held = {r["prompt"].removesuffix(SUFFIX) for r in test}
    train = rows(seed=42, count=TRAIN_ROWS, exclude=held)
    text = {name: "".join(json.dumps(r) + "\n" for r in part) for name, part in (("train", train), ("test", test))}
    return {SAMPLES / f"arithmetic_{name}.jsonl": body for name, body in text.items()}


def main() -> int:
    check = "--check" in sys.argv[1:]
    for path, body in files().items():
        if check:
            if not path.is_file() or path.read_text() != body:
                print(f"{path} differs from what {Path(__file__).name} writes", file=sys.stderr)
                return 1
        else:
            path.write_text(body)
            print(f"wrote {path} ({body.count(chr(10))} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
