"""The output directory as a record of one run, never clobbered by another recipe.

`output_dir/run.json` holds the fingerprint of the recipe fields that change the training
math and the run's status. Starting a different recipe into a directory that holds a run
is refused with a clear message; rerunning the same recipe resumes it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kubetune.errors import RunDirError
from kubetune.fsutil import atomic_write_json, atomic_write_text
from kubetune.recipe.loader import recipe_to_yaml
from kubetune.recipe.schema import Recipe

# Fields that don't change what is learned: changing them keeps the run resumable.
NEUTRAL = {
    "output_dir": None, "k8s": None, "parallel": None, "eval": None,
    # max_steps / epochs: training longer (or stopping earlier) continues the same run.
    # grad_accum: resuming with another world size keeps the global batch by changing it.
    "train": {"resume", "log_every", "save_every", "keep_last", "eval_every", "device", "num_threads", "compile",
              "max_steps", "epochs", "grad_accum"},
    "data": {"cache_dir"},
}


def fingerprint(recipe: Recipe) -> str:
    d = recipe.model_dump(mode="json")
    for section, keys in NEUTRAL.items():
        if keys is None:
            d.pop(section, None)
        else:
            for k in keys:
                d.get(section, {}).pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def read_run(run_dir: Path) -> dict | None:
    p = Path(run_dir) / "run.json"
    return json.loads(p.read_text()) if p.is_file() else None


def claim(run_dir: Path, recipe: Recipe) -> dict | None:
    """Check the directory may hold this run; return the previous run.json (or None)."""
    prev = read_run(run_dir)
    fp = fingerprint(recipe)
    if prev is not None and prev.get("fingerprint") != fp:
        state = "a finished run" if prev.get("status") == "finished" else "an unfinished run"
        raise RunDirError(
            f"output_dir={run_dir} holds {state} of a different recipe (see {Path(run_dir) / 'recipe.yaml'}); "
            f"choose another output_dir=... or delete that directory"
        )
    if prev is None and Path(run_dir).is_dir() and any(Path(run_dir).iterdir()):
        raise RunDirError(f"output_dir={run_dir} is not empty and is not a kubetune run; "
                          f"choose another output_dir=...")
    return prev


def write_run(run_dir: Path, recipe: Recipe, status: str) -> None:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "recipe.yaml", recipe_to_yaml(recipe))
    atomic_write_json(run_dir / "run.json", {"fingerprint": fingerprint(recipe), "status": status})
