"""`data.template: chat` needs a tokenizer with a chat template; a base model has none.

Where it can be told without torch or the network (a local model directory, the embedded
default, a well-known hub id, a tokenizer already in the Hugging Face cache) `kubetune k8s
render` refuses the recipe; otherwise the job's first step loads the tokenizer and refuses
before its pods wait on each other (`training/launch.py`). Training itself still says so where
it formats the first row.

`data.template: auto` (the default) never fails so: it is the chat template where the tokenizer
has one, else Alpaca's prompt (`auto_template`), what Intel's chart prompts a base model with.
Render says which where it can tell offline (`template_note`); the run's log always says.
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


def known_chat_template(name_or_path: str, revision: str | None = None) -> bool | None:
    """Whether the model's tokenizer has a chat template, or None when that needs the tokenizer."""
    directory = Path(name_or_path).expanduser()
    config = directory / "tokenizer_config.json"
    if config.is_file():
        if any((directory / name).is_file() for name in _TEMPLATE_FILES):
            return True
        return _config_template(config)
    known = KNOWN_CHAT_TEMPLATES.get(name_or_path.lower())
    return known if known is not None else _cached_chat_template(name_or_path, revision)


def _config_template(config: Path) -> bool | None:
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return None


def _cached_chat_template(repo_id: str, revision: str | None) -> bool | None:
    """What the Hugging Face cache tells of a hub model's tokenizer (no network), or None."""
    if repo_id.count("/") != 1 or Path(repo_id).expanduser().exists():
        return None  # not a hub id (a GGUF file, a missing directory)
    try:
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(repo_id, "tokenizer_config.json", revision=revision)
        if not isinstance(config, str):
            return None
        if _config_template(Path(config)):
            return True
        # a template saved beside the config; a file the hub said it lacks is cached as missing
        files = [try_to_load_from_cache(repo_id, name, revision=revision) for name in _TEMPLATE_FILES]
    except Exception:  # an id the hub's client refuses, an unreadable cache: not known offline
        return None
    if any(isinstance(f, str) for f in files):
        return True
    return False if all(f is not None for f in files) else None


AUTO_WITHOUT_CHAT = "alpaca"  # Alpaca's prompt, as Intel's chart gives a base model (promptWithInput)


def auto_template(has_chat_template: bool) -> str:
    """What `data.template: auto` is for a tokenizer with or without a chat template."""
    return "chat" if has_chat_template else AUTO_WITHOUT_CHAT


def offline_template(recipe: Recipe) -> str | None:
    """data.template with `auto` decided where that is known offline; None where it needs the tokenizer."""
    if recipe.data.template != "auto":
        return recipe.data.template
    has_template = known_chat_template(recipe.model.name_or_path, recipe.model.revision)
    return None if has_template is None else auto_template(has_template)


def template_note(recipe: Recipe) -> str | None:
    """What `data.template: auto` becomes for this recipe, as far as is known offline (render's note)."""
    if recipe.data.template != "auto":
        return None
    name, template = recipe.model.name_or_path, offline_template(recipe)
    if template is None:
        return (
            f"data.template=auto: decided at run time (the tokenizer of {name} is not known here without "
            "downloading it): its chat template if it has one, else alpaca; the run's log says which"
        )
    why = "its tokenizer's chat template" if template == "chat" else "its tokenizer has no chat template: a base model"
    return f"data.template=auto: {template} for {name} ({why})"


def chat_template_problem(recipe: Recipe, has_template: bool | None = None) -> str | None:
    """The one-line refusal of `data.template: chat` for a tokenizer without a chat template;
    `has_template` is what the caller learnt from the tokenizer (None: what is known offline)."""
    if recipe.data.template != "chat":
        return None
    name = recipe.model.name_or_path
    if has_template is None:
        has_template = known_chat_template(name, recipe.model.revision)
    if has_template is not False:
        return None
    return (
        f"data.template=chat: the tokenizer of model.name_or_path={name} has no chat template (a base model); "
        "set data.template=alpaca or llama2, or a custom string such as '### Question:\\n{input}\\n### Answer:\\n', "
        "or train its chat/instruct variant"
    )
