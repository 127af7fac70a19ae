"""`kubetune generate`: answer one prompt in this process with a run (base + adapter) or an HF
model directory, rendering it with the run's prompt template as `kubetune serve` does
(serve/native/models.py), decoded by models/decoding.py."""

from __future__ import annotations

import torch

from kubetune.models.decoding import generate_text
from kubetune.models.finetune import ModelParts
from kubetune.models.kernels import autocast_context, compute_precision
from kubetune.models.load import DTYPES, load_config, model_config
from kubetune.serve.native.models import model_source


def generate_cli(target: str, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0) -> str:
    source = model_source(target)
    cpu = torch.device("cpu")
    if source.recipe is not None:  # training's precision decision on this machine
        recipe = source.recipe
        precision = compute_precision(recipe.train.precision, model_config(recipe.model), cpu)
        dtype = DTYPES[recipe.with_kernels(precision, "fp32").base_dtype_name()]
    else:
        precision = compute_precision("auto", load_config(str(source.path)), cpu)
        dtype = DTYPES[precision]
    model, tokenizer = source.load(dtype, "sdpa")
    renderer = source.renderer(tokenizer)
    text = renderer.prompt({"instruction": prompt, "input": ""})
    model.eval()
    return generate_text(
        ModelParts.of(model).lm,
        tokenizer,
        text,
        max_new_tokens,
        add_special_tokens=not renderer.uses_chat_template,
        device=cpu,
        autocast=autocast_context(precision, cpu),
        temperature=temperature,
    )
