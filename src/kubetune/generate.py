"""`kubetune generate`: answer a prompt with a run (base + adapter) or an HF model directory,
rendering it with the run's prompt template."""

from __future__ import annotations

from pathlib import Path

import torch

from kubetune.data.templates import PromptRenderer
from kubetune.errors import RunDirError
from kubetune.models.load import load_causal_lm, load_tokenizer
from kubetune.recipe import load_recipe


def generate_cli(target: str, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0) -> str:
    from kubetune.export import load_trained
    from kubetune.training.run import generate_text

    path = Path(target)
    template, system = "chat", None
    if (path / "run.json").is_file():
        recipe = load_recipe(path / "recipe.yaml").recipe
        template, system = recipe.data.template, recipe.data.system_prompt
        model, tokenizer = load_trained(path, recipe)
    elif (path / "config.json").is_file():
        tokenizer = load_tokenizer(str(path))
        model = load_causal_lm(str(path), torch.float32)
        if not getattr(tokenizer, "chat_template", None):
            template = "alpaca"
    else:
        raise RunDirError(f"{target}: neither a kubetune run directory nor an HF model directory (config.json)")
    renderer = PromptRenderer(template, tokenizer, system)
    text = renderer.prompt({"instruction": prompt, "input": ""})
    model.eval()
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.no_grad():
        return generate_text(lm, tokenizer, text, max_new_tokens, add_special_tokens=not renderer.uses_chat_template,
                             device=torch.device("cpu"), temperature=temperature)
