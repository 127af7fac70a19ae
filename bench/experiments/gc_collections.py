"""Does Python's garbage collector pause training steps? A tiny Llama trains 400 steps on the
flashcards (one thread, fp32) with a callback timing every collection: how many full
(generation 2) collections run, how long each takes, and how many objects the process tracks.

    .venv/bin/python bench/experiments/gc_collections.py [--steps 400]
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a file: tests.kit of this checkout

FLASHCARDS = REPO.parent / "shared" / "data" / "medical_flashcards" / "train.jsonl"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    collections: list[tuple[int, float, str]] = []  # generation, seconds, phase
    phase = {"now": "set-up", "t": 0.0}

    def timed(event: str, info: dict) -> None:
        if event == "start":
            phase["t"] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - phase["t"], phase["now"]))

    gc.callbacks.append(timed)
    from tests.kit.models import save_tiny_model

    import kubetune.training.run as run
    from kubetune.models.load import load_tokenizer, resolve_model

    fit = run.fit

    def fit_marked(*a, **k):
        phase["now"] = "steps"
        try:
            return fit(*a, **k)
        finally:
            phase["now"] = "after"

    run.fit = fit_marked
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(Path(tmp, "model"), load_tokenizer(str(resolve_model("smollm2-135m-instruct"))))
        run.train_from_recipe(None, [
            f"model.name_or_path={model}", f"data.train={FLASHCARDS}", "data.eval=null", "data.max_seq_len=256",
            f"data.cache_dir={tmp}/cache", "data.max_train_samples=4000", "train.precision=fp32",
            "train.micro_batch_size=2", "train.grad_accum=1", f"train.max_steps={args.steps}", "train.save_every=0",
            "train.log_every=1000", "eval.generate=0", "train.num_threads=1", "train.compile=false",
            f"output_dir={tmp}/run",
        ])  # fmt: skip
    print(f"objects tracked at the end: {len(gc.get_objects()):,}")
    for where in ("set-up", "steps", "after"):
        full = [s for g, s, ph in collections if g == 2 and ph == where]
        some = [s for g, s, ph in collections if g < 2 and ph == where]
        print(f"{where:7s}: {len(full)} full collections {[round(s * 1e3, 1) for s in full]} ms; "
              f"{len(some)} younger ones, {sum(some) * 1e3:.0f} ms in all")  # fmt: skip


if __name__ == "__main__":
    main()
