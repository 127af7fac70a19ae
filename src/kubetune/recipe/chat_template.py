"""`data.template: chat` needs a tokenizer with a chat template; a base model has none.

Where it can be told without torch or the network (a local model directory, the embedded
default, a well-known hub id) `kubetune k8s render` refuses the recipe; otherwise the job's
first step loads the tokenizer and refuses before its pods wait on each other
(`training/launch.py`). Training itself still says so where it formats the first row.
"""

from __future__ import annotations

import json
from pathlib import Path

from kubetune.recipe.schema import DEFAULT_MODEL, Recipe

# From each repository's tokenizer_config.json on huggingface.co: the chat and instruct
# variants carry a `chat_template`, their base models do not. Only ids checked there are
# listed; any other id is left to the job's first step. Keys are compared lower-case.
KNOWN_CHAT_TEMPLATES: dict[str, bool] = {
    **dict.fromkeys(
        (
            "meta-llama/llama-2-7b-hf",
            "meta-llama/llama-2-13b-hf",
            "meta-llama/llama-2-70b-hf",
            "mistralai/mistral-7b-v0.1",
        ),
        False,
    ),
    **dict.fromkeys(
        (
            "meta-llama/llama-2-7b-chat-hf",
            "meta-llama/llama-2-13b-chat-hf",
            "meta-llama/llama-2-70b-chat-hf",
            "mistralai/mistral-7b-instruct-v0.2",
            "huggingfacetb/smollm2-135m-instruct",
            DEFAULT_MODEL,  # the GGUF's tokenizer.chat_template (a test reads it)
        ),
        True,
    ),
}

# Where transformers finds a saved chat template beside tokenizer_config.json.
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def known_chat_template(name_or_path: str) -> bool | None:
    """Whether the model's tokenizer has a chat template, or None when that needs the tokenizer."""
    directory = Path(name_or_path).expanduser()
    config = directory / "tokenizer_config.json"
    if config.is_file():
        if any((directory / name).is_file() for name in _TEMPLATE_FILES):
            return True
        try:
            return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
        except (OSError, ValueError, AttributeError):
            return None
    return KNOWN_CHAT_TEMPLATES.get(name_or_path.lower())


def chat_template_problem(recipe: Recipe, has_template: bool | None = None) -> str | None:
    """The one-line refusal of `data.template: chat` for a tokenizer without a chat template;
    `has_template` is what the caller learnt from the tokenizer (None: what is known offline)."""
    if recipe.data.template != "chat":
        return None
    name = recipe.model.name_or_path
    if has_template is None:
        has_template = known_chat_template(name)
    if has_template is not False:
        return None
    return (
        f"data.template=chat: the tokenizer of model.name_or_path={name} has no chat template (a base model); "
        "set data.template=alpaca or llama2, or a custom string such as '### Question:\\n{input}\\n### Answer:\\n', "
        "or train its chat/instruct variant"
    )
