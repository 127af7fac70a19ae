"""The one loader of a run's weights: `load_run`, which `kubetune eval`, `generate`, `serve`,
`make-preferences` and `export` read a finished run (or the base model a recipe names)
through. Training writes what it reads (`kubetune.export.weights.save_trained`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kubetune.models.load import DTYPES, load_causal_lm, load_tokenizer, resolve_model
from kubetune.recipe import Recipe
from kubetune.rundir import RunDir


def load_run(
    target: Path | RunDir | Recipe,
    recipe: Recipe | None = None,
    dtype: torch.dtype | None = None,
    attn: str = "sdpa",
    with_adapter: bool = True,
) -> tuple[Any, Any]:
    """(model, tokenizer) of a finished run, or of the base model a recipe names: the one
    loader of a run's weights, so that every reader passes the recipe's `model.revision` and
    `model.trust_remote_code` (a model with its own code loads nowhere without them).

    A LoRA run is its base + the adapter (PEFT), or its base alone with `with_adapter=False`
    (serving installs adapters its own way); a full fine-tune is its trained weights. `recipe`
    defaults to the run's own; `dtype` to the one the base is trained in; `attn` is the
    attention implementation (kubetune's packed-sample one to evaluate on packed rows).
    """
    if isinstance(target, Recipe):
        source = resolve_model(target.model.name_or_path)
        tokenizer = load_tokenizer(source, target.model.revision, target.model.trust_remote_code)
        return _load_base(target, source, dtype, attn), tokenizer
    run = target if isinstance(target, RunDir) else RunDir(Path(target))
    recipe = recipe or run.recipe()
    weights = run.finished_weights(recipe)
    remote = recipe.model.trust_remote_code
    tokenizer = load_tokenizer(str(weights), trust_remote_code=remote)  # the one training saved with the weights
    if recipe.finetune.method == "full":  # a local directory: no revision applies
        return load_causal_lm(str(weights), dtype or DTYPES[recipe.base_dtype_name()], attn, None, remote), tokenizer
    base = _load_base(recipe, resolve_model(recipe.model.name_or_path), dtype, attn)
    if not with_adapter:
        return base, tokenizer
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(weights)), tokenizer


def _load_base(recipe: Recipe, source: str, dtype: torch.dtype | None, attn: str) -> Any:
    """The base model the recipe names, from `source` (resolved), at the recipe's revision."""
    model = recipe.model
    return load_causal_lm(
        source, dtype or DTYPES[recipe.base_dtype_name()], attn, model.revision, model.trust_remote_code
    )
