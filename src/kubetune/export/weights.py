"""The weights of a run, in and out: the trained adapter (PEFT format) or full model (HF
directory) that training writes, and loading them back merged in fp32 for export.

Training calls `save_trained` at the end of a run; every reader, this one included, loads a
run through `kubetune.models.runs.load_run`. Nothing here imports the training engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kubetune.fsutil import atomic_dir
from kubetune.models.runs import load_run
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
        if tokenizer is not None:  # GRPO's rollout adapters go to a server that has its own
            tokenizer.save_pretrained(tmp)


def load_merged(run: RunDir, recipe: Recipe) -> tuple[Any, Any]:
    """(model, tokenizer) of a finished run in fp32: a LoRA adapter merged into the base
    weights (in fp32, so that the adapter's update isn't rounded away), a full fine-tune as it is."""
    model, tokenizer = load_run(run, recipe, dtype=torch.float32)
    if recipe.finetune.method == "lora":
        model = model.merge_and_unload()
    return model, tokenizer
