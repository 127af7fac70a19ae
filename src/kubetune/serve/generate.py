"""`kubetune generate`: answer one prompt in this process with a run (base + adapter) or an HF
model directory, rendering it with the run's prompt template as `kubetune serve` does
(serve/models.py), decoded by models/decoding.py."""

from __future__ import annotations

from pathlib import Path

import torch

from kubetune.data.templates import PromptRenderer
from kubetune.errors import RunDirError
from kubetune.export.weights import base_config, load_run
from kubetune.models.decoding import generate_text
from kubetune.models.finetune import ModelParts
from kubetune.models.kernels import autocast_context, compute_precision
from kubetune.models.load import DTYPES, load_causal_lm, load_config, load_tokenizer
from kubetune.rundir import RunDir


def generate_cli(target: str, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0) -> str:
    path = Path(target)
    run = RunDir(path)
    cpu = torch.device("cpu")
    template, system = "chat", None
    if run.is_run():
        recipe = run.recipe()
        template, system = recipe.data.template, recipe.data.system_prompt
        precision = compute_precision(
            recipe.train.precision, base_config(recipe), cpu
        )  # training's decision on this machine
        model, tokenizer = load_run(run, recipe.with_kernels(precision, "fp32"))
    elif (path / "config.json").is_file():
        precision = compute_precision("auto", load_config(str(path)), cpu)
        tokenizer = load_tokenizer(str(path))
        model = load_causal_lm(str(path), DTYPES[precision])
        if not getattr(tokenizer, "chat_template", None):
            template = "alpaca"
    else:
        raise RunDirError(f"{target}: neither a kubetune run directory nor an HF model directory (config.json)")
    renderer = PromptRenderer(template, tokenizer, system)
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
