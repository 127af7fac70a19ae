"""A run directory (`output_dir`): every path in it, and the record that guards it.

`run.json` holds the fingerprint of the recipe fields that change the training math and the
run's status. Starting a different recipe into a directory that holds a run is refused
with a clear message; rerunning the same recipe resumes it.

Training writes a run directory; export, eval, generate and serve read one. All of them
name its files through `RunDir`, so that a file's name is written once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetune.errors import RunDirError
from kubetune.fsutil import atomic_write_json, atomic_write_text
from kubetune.recipe.loader import _flatten, load_recipe, recipe_to_yaml
from kubetune.recipe.rl import RLSection
from kubetune.recipe.schema import Recipe

# Fields that don't change what is learned: changing them keeps the run resumable.
NEUTRAL: dict[str, set[str] | None] = {
    "output_dir": None,
    "k8s": None,
    "parallel": None,
    "eval": None,
    "monitor": None,
    # max_steps / epochs: training longer (or stopping earlier) continues the same run.
    # grad_accum: resuming with another world size keeps the global batch by changing it.
    "train": {
        "resume",
        "log_every",
        "save_every",
        "keep_last",
        "eval_every",
        "device",
        "num_threads",
        "compile",
        "max_steps",
        "epochs",
        "grad_accum",
    },
    "data": {"cache_dir"},
    "model": {"gated"},  # whether the pods need a token, not what they learn
}


# Keys added after runs were recorded, at the value that means what recipes meant before them:
# left out of the fingerprint at that value, so that a run recorded before them stays resumable.
# A path of keys -> the value it is dropped at (a section added later: its defaults).
ADDED_LATER: dict[tuple[str, ...], object] = {
    ("train", "global_batch_size"): None,
    ("finetune", "rl"): RLSection().model_dump(mode="json"),
    ("data", "columns", "prompt"): "prompt",
}
# data.template's default was `chat` before `auto`, which is chat wherever chat could train (it is
# alpaca only for a tokenizer without a chat template, which chat refused): they fingerprint alike.
FORMERLY = {("data", "template"): ("auto", "chat")}


def fingerprint(recipe: Recipe) -> str:
    d = recipe.model_dump(mode="json")
    for path, unset in ADDED_LATER.items():
        parent = d
        for key in path[:-1]:
            parent = parent.get(key, {})
        if parent.get(path[-1]) == unset:
            parent.pop(path[-1], None)
    for (section, key), (now, before) in FORMERLY.items():
        if d.get(section, {}).get(key) == now:
            d[section][key] = before
    for section, keys in NEUTRAL.items():
        if keys is None:
            d.pop(section, None)
        else:
            for k in keys:
                d.get(section, {}).pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def changed_keys(old: Recipe, new: Recipe) -> tuple[list[str], list[str]]:
    """(keys that keep the run resumable, keys that change what is learned) that differ between
    two recipes of one run. A change is resumable when the fingerprint that `RunDir.claim` checks
    stays the same: the operator (an edited FineTune) and `k8s submit` (a job submitted again)
    refuse the others, which the pods would refuse at their next start."""
    before, after = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if fingerprint(old) == fingerprint(new):
        return changed, []
    return [k for k in changed if _neutral(k)], [k for k in changed if not _neutral(k)]


def _neutral(key: str) -> bool:
    section, _, rest = key.partition(".")
    if section not in NEUTRAL:
        return False
    fields = NEUTRAL[section]
    return fields is None or rest.split(".")[0] in fields


@dataclass(frozen=True)
class RunDir:
    path: Path

    # --- the files ------------------------------------------------------------------
    @property
    def recipe_file(self) -> Path:
        return self.path / "recipe.yaml"

    @property
    def record_file(self) -> Path:
        return self.path / "run.json"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_file(self) -> Path:
        return self.path / "summary.json"

    @property
    def loss_curve(self) -> Path:
        return self.path / "loss_curve.png"

    @property
    def tracking_file(self) -> Path:
        """The experiment trackers' run ids (`monitor.report_to`): a resume continues the same runs."""
        return self.path / "tracking.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step}"

    @property
    def merged(self) -> Path:
        return self.path / "merged"

    def weights(self, method: str) -> Path:
        """The trained weights: adapter/ (PEFT format) for LoRA, model/ (HF directory) for a full fine-tune."""
        return self.path / ("adapter" if method == "lora" else "model")

    # --- the record -----------------------------------------------------------------
    def is_run(self) -> bool:
        return self.record_file.is_file()

    def read_record(self) -> dict[str, Any] | None:
        return json.loads(self.record_file.read_text()) if self.is_run() else None

    def claim(self, recipe: Recipe) -> dict[str, Any] | None:
        """Check the directory may hold this run; return the previous run.json (or None)."""
        prev = self.read_record()
        if prev is not None and prev.get("fingerprint") != fingerprint(recipe):
            state = "a finished run" if prev.get("status") == "finished" else "an unfinished run"
            raise RunDirError(
                f"output_dir={self.path} holds {state} of a different recipe (see {self.recipe_file}); "
                f"choose another output_dir=... or delete that directory"
            )
        if prev is None and self.path.is_dir() and any(self.path.iterdir()):
            raise RunDirError(
                f"output_dir={self.path} is not empty and is not a kubetune run; choose another output_dir=..."
            )
        return prev

    def write_record(self, recipe: Recipe, status: str) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.recipe_file, recipe_to_yaml(recipe))
        atomic_write_json(self.record_file, {"fingerprint": fingerprint(recipe), "status": status})

    def tracking_ids(self) -> dict[str, Any]:
        """Per tracker of `monitor.report_to`, what continues its run (e.g. {"mlflow": {"run_id": ...}})."""
        return json.loads(self.tracking_file.read_text()) if self.tracking_file.is_file() else {}

    # --- reading a finished run -----------------------------------------------------
    def recipe(self, overrides: list[str] | None = None) -> Recipe:
        if not self.recipe_file.is_file():
            raise RunDirError(
                f"{self.path} is not a kubetune run directory (no recipe.yaml); pass the output_dir of `kubetune train`"
            )
        return load_recipe(self.recipe_file, overrides or []).recipe

    def finished_weights(self, recipe: Recipe) -> Path:
        path = self.weights(recipe.finetune.method)
        if not path.is_dir():
            raise RunDirError(
                f"{self.path} has no {path.name}/ yet (the run has not finished); "
                f"rerun `kubetune train` with the same recipe to finish it"
            )
        return path
