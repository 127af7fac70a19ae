"""Recipe loading: YAML file + dotted `key=value` overrides -> validated `Recipe`.

All problems are reported at once, one line each, naming the dotted key and the fix.
Provenance (default / file / command line) is kept for `kubetune recipe show`.
"""

from __future__ import annotations

import difflib
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from kubetune.errors import RecipeError
from kubetune.recipe.schema import Recipe

BUILTIN_RECIPES_PACKAGE = "kubetune.recipes"
DEFAULT_RECIPE = "smollm2-135m-lora-cpu"


def builtin_recipes() -> dict[str, Path]:
    """Named recipes shipped with kubetune: name -> path."""
    root = importlib.resources.files(BUILTIN_RECIPES_PACKAGE)
    return {p.name[: -len(".yaml")]: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def resolve_recipe_path(recipe: str | None) -> Path | None:
    """A file path, a builtin recipe name, or None for the embedded default."""
    if recipe is None:
        return builtin_recipes()[DEFAULT_RECIPE]
    p = Path(recipe)
    if p.is_file():
        return p
    named = builtin_recipes()
    if recipe in named:
        return named[recipe]
    hint = difflib.get_close_matches(recipe, list(named), n=1)
    suggestion = f" (did you mean `{hint[0]}`?)" if hint else f"; builtin recipes: {', '.join(sorted(named))}"
    raise RecipeError(f"recipe file not found: {recipe}{suggestion}")


@dataclass
class LoadedRecipe:
    recipe: Recipe
    source: Path | None
    provenance: dict[str, str] = field(default_factory=dict)  # dotted key -> "default" | file | "command line"


def all_keys(model: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """Every dotted key the schema accepts (leaves and sections)."""
    keys: list[str] = []
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(all_keys(ann, dotted + "."))
    return keys


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise RecipeError(f"override `{text}` is not key=value (e.g. train.lr=1e-4)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise RecipeError(f"override `{text}` has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    if isinstance(value, dict) and not raw.lstrip().startswith("{"):
        value = raw  # "Q: {instruction}" is a template string, not a YAML mapping
    return key, value


def _set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    cur = d
    for part in parts[:-1]:
        nxt = cur.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[part] = nxt
        cur = nxt
    cur[parts[-1]] = value


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise RecipeError(f"cannot read recipe {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise RecipeError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping of sections (model:, data:, train:, ...)")
    return data


# Names users bring from HF TrainingArguments / torchtune / PEFT -> kubetune's key.
ALIASES = {
    "learning_rate": "train.lr",
    "num_train_epochs": "train.epochs",
    "num_epochs": "train.epochs",
    "per_device_train_batch_size": "train.micro_batch_size",
    "batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "gradient_accumulation": "train.grad_accum",
    "lr_scheduler_type": "train.lr_schedule",
    "warmup": "train.warmup_steps",
    "max_length": "data.max_seq_len",
    "seq_len": "data.max_seq_len",
    "max_seq_length": "data.max_seq_len",
    "lora_r": "lora.r",
    "rank": "lora.r",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "model_name_or_path": "model.name_or_path",
    "dataset": "data.train",
    "train_file": "data.train",
    "validation_file": "data.eval",
    "bf16": "train.precision",
    "output": "output_dir",
    "save_steps": "train.save_every",
    "eval_steps": "train.eval_every",
}


def suggest_key(dotted: str, keys: list[str]) -> str | None:
    leaf = dotted.rsplit(".", 1)[-1]
    if leaf in ALIASES:
        return ALIASES[leaf]
    hint = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.6)
    if hint:
        return hint[0]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return same_leaf[0]
    section = dotted.rsplit(".", 1)[0] + "." if "." in dotted else ""
    siblings = [k.rsplit(".", 1)[-1] for k in keys if k.startswith(section) and "." not in k[len(section) :]]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.5)
    return section + close[0] if close else None


def format_validation_error(err: ValidationError, keys: list[str]) -> list[str]:
    lines: list[str] = []
    for e in err.errors():
        dotted = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-after"))
        if e["type"] == "extra_forbidden":
            hint = suggest_key(dotted, keys)
            fix = f"did you mean `{hint}`?" if hint else "see `kubetune recipe reference` for the valid keys"
            lines.append(f"unknown recipe key `{dotted}`: {fix}")
        elif e["type"] == "literal_error":
            expected = e.get("ctx", {}).get("expected", "")
            lines.append(f"`{dotted}`: got {e.get('input')!r}, expected {expected}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            where = f"`{dotted}`" if dotted else "recipe"
            lines.append(f"{where}: {msg} (got {e.get('input')!r})" if dotted else f"{where}: {msg}")
    return lines


def load_recipe(recipe: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> LoadedRecipe:
    """Load and validate a recipe; raise RecipeError listing every problem."""
    path = resolve_recipe_path(str(recipe) if recipe is not None else None)
    return recipe_from_data(_read_yaml(path) if path else {}, overrides, path)


def recipe_from_data(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), source: Path | None = None
) -> LoadedRecipe:
    """Validate recipe data already read (a file's, or a FineTune's spec.recipe); RecipeError lists every problem."""
    provenance = {k: str(source) if source else "inline" for k in _flatten(data)}
    problems: list[str] = []
    for text in overrides:
        try:
            key, value = parse_override(text)
        except RecipeError as e:
            problems.extend(e.problems)
            continue
        _set_dotted(data, key, value)
        provenance[key] = "command line"
    keys = all_keys()
    recipe_obj: Recipe | None = None
    try:
        recipe_obj = Recipe.model_validate(data)
    except ValidationError as err:
        problems.extend(format_validation_error(err, keys))
    if problems or recipe_obj is None:
        raise RecipeError(*problems)
    for key in _flatten(recipe_obj.model_dump()):
        provenance.setdefault(key, "default")
    return LoadedRecipe(recipe=recipe_obj, source=source, provenance=provenance)


def recipe_to_yaml(recipe: Recipe) -> str:
    """The recipe as YAML text, its characters as they are (a CJK template stays readable in a
    ConfigMap or a run's recipe.yaml; every reader decodes UTF-8), not as \\u escapes."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def reference_markdown() -> str:
    """The recipe reference table (docs/recipe.md), generated from the schema's field descriptions."""
    rows = ["| key | default | meaning |", "|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            ann = info.annotation
            dotted = f"{prefix}{name}"
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, dotted + ".")
                continue
            default = info.get_default(call_default_factory=True)
            rows.append(f"| `{dotted}` | `{default!r}` | {info.description or ''} |")

    walk(Recipe, "")
    return "\n".join(rows)
