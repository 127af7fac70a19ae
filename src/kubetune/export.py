"""Export a run: the adapter (PEFT format) or a merged HF model directory (safetensors)."""

from __future__ import annotations

from pathlib import Path

import torch

from kubetune.errors import RunDirError
from kubetune.fsutil import atomic_dir
from kubetune.models.load import DTYPES, load_causal_lm, load_tokenizer, resolve_model
from kubetune.recipe import Recipe, load_recipe


def _run_recipe(run_dir: Path) -> Recipe:
    if not (run_dir / "recipe.yaml").is_file():
        raise RunDirError(f"{run_dir} is not a kubetune run directory (no recipe.yaml); "
                          f"pass the output_dir of `kubetune train`")
    return load_recipe(run_dir / "recipe.yaml").recipe


def _weights_dir(run_dir: Path, recipe: Recipe) -> Path:
    name = "adapter" if recipe.finetune.method == "lora" else "model"
    path = run_dir / name
    if not path.is_dir():
        raise RunDirError(f"{run_dir} has no {name}/ yet (the run has not finished); "
                          f"rerun `kubetune train` with the same recipe to finish it")
    return path


def load_trained(run_dir: Path, recipe: Recipe | None = None, dtype: torch.dtype | None = None,
                 for_training: bool = False):
    """(model, tokenizer) of a finished run: base + adapter (LoRA) or the full model."""
    from kubetune.models.attention import register

    run_dir = Path(run_dir)
    recipe = recipe or _run_recipe(run_dir)
    weights = _weights_dir(run_dir, recipe)
    dtype = dtype or DTYPES[recipe.base_dtype_name()]
    attn = register() if for_training else "sdpa"
    tokenizer = load_tokenizer(str(weights))
    if recipe.finetune.method == "full":
        return load_causal_lm(str(weights), dtype, attn), tokenizer
    from peft import PeftModel

    base = load_causal_lm(resolve_model(recipe.model.name_or_path), dtype, attn, recipe.model.revision,
                          recipe.model.trust_remote_code)
    return PeftModel.from_pretrained(base, str(weights)), tokenizer


def export_run(run_dir: Path, merged: bool, output: Path | None = None) -> Path:
    run_dir = Path(run_dir)
    recipe = _run_recipe(run_dir)
    weights = _weights_dir(run_dir, recipe)
    if not merged:
        if output is None:
            return weights
        with atomic_dir(output) as tmp:
            for f in weights.iterdir():
                (tmp / f.name).write_bytes(f.read_bytes())
        return output
    output = Path(output) if output else run_dir / "merged"
    # Merge in fp32 so the adapter's update isn't rounded away, then save in that precision.
    model, tokenizer = load_trained(run_dir, recipe, dtype=torch.float32)
    if recipe.finetune.method == "lora":
        model = model.merge_and_unload()
    model.config.use_cache = True
    if not model.config.architectures:
        model.config.architectures = [type(model).__name__]
    with atomic_dir(output) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
    return output
