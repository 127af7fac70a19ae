"""Whether a recipe's model needs a Hugging Face token (a gated repository on the Hub).

The Hub answers a gated repository's files with 401 to a request without a token and 403 to
a token whose account has not been granted access; training then stops at its first step
(`kubetune k8s doctor` names that from the pods' logs). Told before any pod starts, the user
fixes it where they are: `k8s submit` and `k8s render --check` refuse a gated model without
a token source, the operator refuses a FineTune without `spec.hfTokenSecretRef`, and the pods
of a gated model require the token's Secret instead of starting without it.

`model.gated` says it for any model; null looks the hub id up in `GATED_MODELS`.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

from kubetune.recipe.schema import Recipe

# From the repositories' pages on huggingface.co: each asks the user to accept a licence or
# share contact details before it serves a file. Only ids known to be gated are listed (any
# other id is treated as public unless model.gated says otherwise); compared lower-case.
GATED_MODELS = (
    "meta-llama/*",  # every repository of meta-llama: Llama 2, Llama 3.x, Code Llama
    "google/gemma*",  # Gemma's terms of use
    "mistralai/mistral-7b-v0.*",  # mistralai's contact-details gate
    "mistralai/mistral-7b-instruct-v0.*",
    "mistralai/mixtral-8x7b-*",
    "mistralai/mixtral-8x22b-*",
)


def known_gated(name_or_path: str) -> bool:
    """A hub id of `GATED_MODELS`; a local file or directory never is (it needs no download)."""
    if Path(name_or_path).expanduser().exists():
        return False
    name = name_or_path.strip().lower()
    return any(fnmatchcase(name, pattern) for pattern in GATED_MODELS)


def needs_token(recipe: Recipe) -> bool:
    """model.gated, else whether the model is a known gated hub id."""
    gated = recipe.model.gated
    return known_gated(recipe.model.name_or_path) if gated is None else gated


def missing_token_problem(recipe: Recipe) -> str | None:
    """The one-line refusal of a gated model without a token source (None: no token needed)."""
    if not needs_token(recipe):
        return None
    name = recipe.model.name_or_path
    return (
        f"model.name_or_path={name} is gated on the Hugging Face Hub (without a token its pods fail with 401): "
        "give a token with --hf-token-file FILE (or $HF_TOKEN), or for a FineTune name its Secret in "
        "spec.hfTokenSecretRef; set model.gated=false if this model needs none"
    )
