"""`kubetune export RUN_DIR [--merged]`: a run's trained weights as they are (the adapter, or a
full fine-tune's model directory), or merged into the base model as one HF safetensors directory."""

from __future__ import annotations

from pathlib import Path

from kubetune.export.weights import load_merged
from kubetune.fsutil import atomic_dir
from kubetune.rundir import RunDir


def export_run(run_dir: Path, merged: bool, output: Path | None = None) -> Path:
    """`kubetune export`: the trained weights as they are (copied to `output`, if given), or
    merged into the base model as an HF safetensors directory (default RUN_DIR/merged)."""
    run = RunDir(Path(run_dir))
    recipe = run.recipe()
    weights = run.finished_weights(recipe)
    if not merged:
        if output is None:
            return weights
        with atomic_dir(output) as tmp:
            for f in weights.iterdir():
                (tmp / f.name).write_bytes(f.read_bytes())
        return output
    output = Path(output) if output else run.merged
    model, tokenizer = load_merged(run, recipe)  # saved in fp32, the precision it was merged in
    model.config.use_cache = True
    if not model.config.architectures:
        model.config.architectures = [type(model).__name__]
    with atomic_dir(output) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
    return output
