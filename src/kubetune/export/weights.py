"""The weights of a run, in and out: the trained adapter (PEFT format) or full model (HF
directory) that training writes, and loading them back (as they are, or merged in fp32).

Training calls `save_trained` at the end of a run; `kubetune eval`, `generate`, `export`
and serving read through `load_run`. Nothing here imports the training engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kubetune.fsutil import atomic_dir
from kubetune.models.load import DTYPES, load_causal_lm, load_config, load_tokenizer, resolve_model
from kubetune.recipe import Recipe
from kubetune.rundir import RunDir


def save_trained(
    model: Any, lm: Any, tokenizer: Any, method: str, target: Path, full_state: dict[str, torch.Tensor] | None = None
) -> None:
    """LoRA: the adapter in PEFT format. Full: the HF model directory. Written atomically.

    `full_state` holds gathered weights when `model`'s own tensors are shards (FSDP2,
    tensor parallel): they are written instead of the model's tensors.
    """
    with atomic_dir(target) as tmp:
        if full_state is None:
            model.save_pretrained(tmp, safe_serialization=True)
        elif method == "lora":
            from peft.utils import get_peft_model_state_dict
            from safetensors.torch import save_file

            adapter = get_peft_model_state_dict(model, state_dict=full_state)
            save_file({k: v.contiguous() for k, v in adapter.items()}, tmp / "adapter_model.safetensors")
            model.peft_config["default"].save_pretrained(tmp)
        else:
            lm.save_pretrained(tmp, state_dict=full_state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


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


def base_config(recipe: Recipe) -> Any:
    """The config of the base model a recipe names, at its revision (what precision and the
    KV cache are decided from before any weights load)."""
    model = recipe.model
    return load_config(resolve_model(model.name_or_path), model.revision, model.trust_remote_code)


def _load_base(recipe: Recipe, source: str, dtype: torch.dtype | None, attn: str) -> Any:
    """The base model the recipe names, from `source` (resolved), at the recipe's revision."""
    model = recipe.model
    return load_causal_lm(
        source, dtype or DTYPES[recipe.base_dtype_name()], attn, model.revision, model.trust_remote_code
    )


def load_merged(run: RunDir, recipe: Recipe) -> tuple[Any, Any]:
    """(model, tokenizer) of a finished run in fp32: a LoRA adapter merged into the base
    weights (in fp32, so that the adapter's update isn't rounded away), a full fine-tune as it is."""
    model, tokenizer = load_run(run, recipe, dtype=torch.float32)
    if recipe.finetune.method == "lora":
        model = model.merge_and_unload()
    return model, tokenizer
