"""GRPO's rewards: the built-in verifiable rewards, user functions by import path, and scoring.

A reward function has TRL's signature, `f(prompts, completions, **columns) -> list[float | None]`:
`prompts` and `completions` are aligned lists (text, or for chat prompts lists of messages),
and every other column of the dataset arrives as a keyword argument holding a list aligned with
them, beside `completion_ids` (the completions' token ids) when the caller has them. A function
returns one reward per completion, or None where it does not apply (TRL turns None into NaN and
leaves it out of the weighted sum: `score` does the same).

`finetune.rl.reward_funcs` lists the functions, each a built-in name, an import path
`module:function`, or `{"name": ..., "options": {...}}` with a built-in's options;
`finetune.rl.reward_weights` weighs them (one each, default 1.0). The built-ins (each class's
docstring has its options and defaults):

- `accuracy`: 1.0 when the completion's answer (all of it, or a regex's last match) equals the
  reference column's (`answer`), numerically within a tolerance or as text; else 0.0.
- `format`: 1.0 when a regex matches the completion, else 0.0.
- `length`: a penalty in [-1, 0], linear in the characters (or tokens) beyond a target.
- `token_f1`: SQuAD's token F1 of the completion against the reference column.
- `json_schema`: 1.0 when the completion is JSON that validates against a schema (an option or a
  column), else 0.0.

Nothing here imports torch: the scores are plain lists, NaN where a function returned None.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import functools
import importlib
import inspect
import json
import math
import re
import string
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from kubetune.errors import RecipeError, UserError, first_line

FUNCS_KEY = "finetune.rl.reward_funcs"
WEIGHTS_KEY = "finetune.rl.reward_weights"
# what TRL keeps out of the columns it hands a reward function (its own arguments)
NOT_COLUMNS = ("prompt", "completion", "completion_ids")

RewardFunc = Callable[..., Sequence[Any]]


class RewardError(UserError):
    """A reward function raised, or returned something other than one finite float or None per completion."""


class Reward(NamedTuple):
    name: str  # TRL's metric name: rewards/<name>/mean
    func: RewardFunc
    weight: float


class Scores(NamedTuple):
    per_function: list[list[float]]  # [completion][function], NaN where the function returned None
    total: list[float]  # the weighted sum over the functions that scored it; NaN where none did


# --- the built-ins -------------------------------------------------------------------------------


def completion_text(completion: Any) -> str:
    """A completion's text: itself, or the content of the last message of a chat completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content") or "")
    raise TypeError(f"a completion must be text or a list of messages, got {type(completion).__name__}")


def _reference(columns: Mapping[str, Sequence[Any]], column: str) -> Sequence[Any]:
    if column not in columns:
        known = ", ".join(sorted(k for k in columns if k not in ("prompts", "completions", "completion_ids")))
        raise ValueError(f"the data has no column `{column}` (columns: {known or 'none'}); set the option `column`")
    return columns[column]


_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")


def parse_number(text: str) -> float | None:
    """A number written plainly (" -3.5 ", "42.", "1e3", "1,234" with commas between thousands),
    else None: whitespace is removed and one trailing period dropped; anything else (words, units,
    fractions, "1,2") is not a number."""
    compact = re.sub(r"\s", "", text).removesuffix(".")
    if "," in compact:
        compact = compact.replace(",", "") if _THOUSANDS.fullmatch(compact) else ""
    return float(compact) if _NUMBER.fullmatch(compact) else None


def _plain_text(text: str, case_sensitive: bool) -> str:
    collapsed = " ".join(text.split()).removesuffix(".")
    return collapsed if case_sensitive else collapsed.casefold()


@dataclasses.dataclass(frozen=True)
class Accuracy:
    """1.0 when the completion's answer equals the row's reference, 0.0 when not, None when the row has none.

    `pattern`: a regex whose last match in the completion is the answer (its group `answer`, else its
    first group, else the whole match; no match scores 0.0). Unset, the whole completion is the answer,
    so an answer wrapped in words scores 0.0. `compare`: `numeric` (both parse as plain numbers, see
    `parse_number`, and differ by at most tolerance x max(1, |reference|)), `exact` (the texts equal
    after collapsing whitespace and dropping a trailing period; case-folded unless `case_sensitive`), or
    `auto`: numeric where the reference is a number, else exact."""

    column: str = "answer"
    pattern: str | None = None
    compare: Literal["auto", "exact", "numeric"] = "auto"
    tolerance: float = 1e-6
    case_sensitive: bool = False

    def __post_init__(self) -> None:
        _check_regex(self.pattern, "pattern")
        if not self.tolerance >= 0:
            raise ValueError(f"`tolerance` must be >= 0, got {self.tolerance}")

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        references = _reference(columns, self.column)
        return [self.one(completion_text(c), ref) for c, ref in zip(completions, references)]

    def one(self, completion: str, reference: Any) -> float | None:
        if reference is None or str(reference).strip() == "":
            return None
        answer = self.extract(completion)
        if answer is None:
            return 0.0
        return 1.0 if self.equal(answer, str(reference)) else 0.0

    def extract(self, completion: str) -> str | None:
        if self.pattern is None:
            return completion
        matches = list(re.finditer(self.pattern, completion))
        if not matches:
            return None
        last = matches[-1]
        if "answer" in last.re.groupindex:
            return last.group("answer")
        return last.group(1) if last.re.groups else last.group(0)

    def equal(self, answer: str, reference: str) -> bool:
        wanted = parse_number(reference) if self.compare != "exact" else None
        if self.compare == "numeric" or wanted is not None:
            got = parse_number(answer)
            if wanted is None or got is None:
                return False
            return abs(got - wanted) <= self.tolerance * max(1.0, abs(wanted))
        return _plain_text(answer, self.case_sensitive) == _plain_text(reference, self.case_sensitive)


@dataclasses.dataclass(frozen=True)
class Format:
    """1.0 when `pattern` matches the completion, else 0.0. `match`: `full` (the whole completion,
    stripped of surrounding whitespace) or `search` (anywhere in it). `.` matches newlines too."""

    pattern: str
    match: Literal["full", "search"] = "full"

    def __post_init__(self) -> None:
        _check_regex(self.pattern, "pattern")

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        regex = re.compile(self.pattern, re.DOTALL)
        test = regex.fullmatch if self.match == "full" else regex.search
        return [1.0 if test(completion_text(c).strip()) else 0.0 for c in completions]


@dataclasses.dataclass(frozen=True)
class Length:
    """A length penalty in [-1, 0]: 0 at `target`, falling linearly by 1 per `scale` units away from
    it (default: `target`), never below -1. `only_longer` (default) leaves completions shorter than
    the target at 0. `unit`: `chars` (the completion text's characters) or `tokens` (its
    completion_ids, which the trainer passes as TRL does)."""

    target: int
    unit: Literal["chars", "tokens"] = "chars"
    scale: int | None = None
    only_longer: bool = True

    def __post_init__(self) -> None:
        if self.target <= 0:
            raise ValueError(f"`target` must be > 0, got {self.target}")
        if self.scale is not None and self.scale <= 0:
            raise ValueError(f"`scale` must be > 0, got {self.scale}")

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        return [self.penalty(n) for n in self.lengths(completions, columns.get("completion_ids"))]

    def lengths(self, completions: list[Any], completion_ids: Sequence[Sequence[int]] | None) -> list[int]:
        if self.unit == "chars":
            return [len(completion_text(c)) for c in completions]
        if completion_ids is None:
            raise ValueError("`unit: tokens` needs the completions' token ids, and the caller passed none")
        return [len(ids) for ids in completion_ids]

    def penalty(self, length: int) -> float:
        distance = length - self.target if self.only_longer else abs(length - self.target)
        return -min(1.0, max(0, distance) / (self.scale or self.target))


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def answer_tokens(text: str, normalize: bool) -> list[str]:
    """SQuAD's tokens: lower-cased, punctuation and the articles a/an/the removed, split on whitespace."""
    if normalize:
        text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return text.split()


def token_f1(prediction: list[str], reference: list[str]) -> float:
    """F1 of the shared tokens (counted with multiplicity); two empty answers agree."""
    if not prediction or not reference:
        return float(prediction == reference)
    shared = sum((collections.Counter(prediction) & collections.Counter(reference)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(prediction), shared / len(reference)
    return 2 * precision * recall / (precision + recall)


@dataclasses.dataclass(frozen=True)
class TokenF1:
    """SQuAD's token F1 of the completion against the row's reference (None where the row has none).
    `normalize`: lower-case and drop punctuation and articles first, as SQuAD's evaluation does."""

    column: str = "answer"
    normalize: bool = True

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        references = _reference(columns, self.column)
        return [
            None
            if ref is None
            else token_f1(answer_tokens(completion_text(c), self.normalize), answer_tokens(str(ref), self.normalize))
            for c, ref in zip(completions, references)
        ]


_FENCE = re.compile(r"```[\w-]*\s*\n(.*?)\n?```", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class JsonSchema:
    """1.0 when the completion parses as JSON and validates against the schema, else 0.0. The schema
    is `schema` (a JSON Schema object) or the row's `column` (an object or its JSON text); with neither,
    any JSON scores 1.0. `strip_fence`: a completion that is one markdown code fence is read inside it.
    Needs the `jsonschema` package when a schema is given."""

    schema: dict[str, Any] | None = None
    column: str | None = None
    strip_fence: bool = True

    def __post_init__(self) -> None:
        if self.schema is not None and self.column is not None:
            raise ValueError("give `schema` or `column`, not both")
        if self.schema is not None:
            _validator(json.dumps(self.schema, sort_keys=True))

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        schemas = _reference(columns, self.column) if self.column else [self.schema] * len(completions)
        return [self.one(completion_text(c), s) for c, s in zip(completions, schemas)]

    def one(self, completion: str, schema: Any) -> float:
        text = completion.strip()
        fenced = _FENCE.fullmatch(text) if self.strip_fence else None
        try:
            value = json.loads(fenced.group(1) if fenced else text)
        except json.JSONDecodeError:
            return 0.0
        if schema is None:
            return 1.0
        schema_text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        return 1.0 if _validator(schema_text).is_valid(value) else 0.0


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str) -> Any:
    """A validator for a JSON Schema given as JSON text (cached: a column repeats its schemas)."""
    try:
        import jsonschema
    except ImportError:
        raise ValueError("a JSON schema needs the `jsonschema` package: pip install jsonschema") from None
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the schema is not JSON ({e.msg})") from None
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"not a valid JSON Schema: {first_line(e)}") from None
    return cls(schema)


def _check_regex(pattern: str | None, option: str) -> None:
    if pattern is None:
        return
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"`{option}` is not a valid regular expression ({e})") from None


BUILTIN_REWARDS: dict[str, type] = {
    "accuracy": Accuracy,
    "format": Format,
    "length": Length,
    "token_f1": TokenF1,
    "json_schema": JsonSchema,
}


# --- building the list from the recipe ------------------------------------------------------------


def build_rewards(spec: Sequence[Any], weights: Sequence[float] | None = None) -> list[Reward]:
    """The reward functions `finetune.rl.reward_funcs` names, with their weights; a RecipeError
    lists every problem at once (unknown names with the nearest built-in, bad options, imports)."""
    if not spec:
        raise RecipeError(f"{FUNCS_KEY}: no reward function; name at least one, e.g. [accuracy]")
    problems: list[str] = []
    named: list[tuple[str, RewardFunc]] = []
    for index, entry in enumerate(spec):
        try:
            named.append(_one_reward(entry, f"{FUNCS_KEY}[{index}]"))
        except RecipeError as e:
            problems.extend(e.problems)
    problems.extend(_weight_problems(weights, len(spec)))
    if problems:
        raise RecipeError(*problems)
    chosen = list(weights) if weights is not None else [1.0] * len(named)
    return [Reward(name, func, float(w)) for (name, func), w in zip(_unique_names(named), chosen)]


def _one_reward(entry: Any, where: str) -> tuple[str, RewardFunc]:
    name, options = _name_and_options(entry, where)
    if ":" in name:
        if options:
            raise RecipeError(f"{where}: `options` are for the built-in rewards; `{name}` takes none")
        func = import_reward(name, where)
        return imported_name(func), func
    if name not in BUILTIN_REWARDS:
        close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1, cutoff=0.5)
        fix = f"did you mean `{close[0]}`?" if close else f"built-ins: {', '.join(BUILTIN_REWARDS)}"
        raise RecipeError(f"{where}: unknown reward `{name}`; {fix} (or a function as `module:function`)")
    return name, make_builtin(name, options, where)


def _name_and_options(entry: Any, where: str) -> tuple[str, dict[str, Any]]:
    if isinstance(entry, str):
        return entry, {}
    if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
        raise RecipeError(f"{where}: give a name, `module:function`, or {{name: ..., options: {{...}}}}; got {entry!r}")
    extra = sorted(set(entry) - {"name", "options"})
    if extra:
        raise RecipeError(f"{where}: unknown key `{extra[0]}`; an entry has `name` and `options`")
    options = entry.get("options") or {}
    if not isinstance(options, Mapping):
        raise RecipeError(f"{where}.options: must be a mapping of option: value, got {options!r}")
    return entry["name"], dict(options)


def make_builtin(name: str, options: Mapping[str, Any], where: str = FUNCS_KEY) -> RewardFunc:
    """The built-in reward `name` with `options`; a RecipeError names each bad option and the fix."""
    cls = BUILTIN_REWARDS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems = [_unknown_option(key, list(fields), name, where) for key in options if key not in fields]
    missing = [f for f, info in fields.items() if _required(info) and f not in options]
    problems += [f"{where}: reward `{name}` needs the option `{f}`" for f in missing]
    hints = typing.get_type_hints(cls)
    problems += [_type_problem(key, value, hints[key], where) for key, value in options.items() if key in fields]
    problems = [p for p in problems if p]
    if problems:
        raise RecipeError(*problems)
    try:
        func: RewardFunc = cls(**options)
    except ValueError as e:
        raise RecipeError(f"{where}: reward `{name}`: {e}") from None
    return func


def _required(field: dataclasses.Field[Any]) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _unknown_option(key: str, known: list[str], name: str, where: str) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    fix = f"did you mean `{close[0]}`?" if close else f"its options: {', '.join(known)}"
    return f"{where}: reward `{name}` has no option `{key}`; {fix}"


def _type_problem(key: str, value: Any, hint: Any, where: str) -> str:
    """'' when `value` fits the option's annotation (str, int, float, bool, a dict, Literal, X | None)."""
    allowed = typing.get_args(hint) if _is_union(hint) else (hint,)
    if any(_fits(value, a) for a in allowed):
        return ""
    return f"{where}.options.{key}: got {value!r}, expected {_describe(allowed)}"


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) is typing.Union or isinstance(hint, types.UnionType)


def _fits(value: Any, annotation: Any) -> bool:
    if typing.get_origin(annotation) is Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    base = typing.get_origin(annotation) or annotation
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, base)


def _describe(allowed: tuple[Any, ...]) -> str:
    names: list[str] = []
    for a in allowed:
        if typing.get_origin(a) is Literal:
            names.extend(repr(v) for v in typing.get_args(a))
        else:
            names.append("null" if a is type(None) else (typing.get_origin(a) or a).__name__)
    return " | ".join(names)


def import_reward(path: str, where: str = FUNCS_KEY) -> RewardFunc:
    """The function at `module:attribute` (the attribute may be dotted); one line naming the path and
    the fix when the module cannot be imported, or the attribute is missing or not callable."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise RecipeError(f"{where}: `{path}` is not `module:function` (e.g. my_rewards:exact_match)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RecipeError(
            f"{where}: cannot import `{module_name}` for `{path}` ({first_line(e)}); "
            "put its folder on PYTHONPATH or install its package"
        ) from None
    except Exception as e:  # a user's module failing at import: its own error, on one line
        raise RecipeError(
            f"{where}: importing `{module_name}` for `{path}` failed: {type(e).__name__}: {first_line(e)}"
        ) from None
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise RecipeError(f"{where}: `{module_name}` has no `{attribute}`{_nearest_attribute(target, part)}")
        target = getattr(target, part)
    if not callable(target):
        raise RecipeError(
            f"{where}: `{path}` is a {type(target).__name__}, not a function; point it at a function "
            "f(prompts, completions, **columns) -> list[float | None]"
        )
    if inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__):
        raise RecipeError(f"{where}: `{path}` is async; kubetune calls reward functions synchronously, make it a def")
    return typing.cast(RewardFunc, target)


def _nearest_attribute(owner: Any, name: str) -> str:
    public = [a for a in dir(owner) if not a.startswith("_") and callable(getattr(owner, a, None))]
    close = difflib.get_close_matches(name, public, n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else f" (its functions: {', '.join(public[:8]) or 'none'})"


def imported_name(func: RewardFunc) -> str:
    """TRL's name for a reward function (`get_callable_name`): a partial's function's name, a
    function's `__name__`, else its class name."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def _weight_problems(weights: Sequence[float] | None, count: int) -> list[str]:
    if weights is None:
        return []
    if len(weights) != count:
        fix = "give one weight per function, in the same order (or leave it out: 1.0 each)"
        return [f"{WEIGHTS_KEY}: {len(weights)} weight(s) for {count} reward function(s) in {FUNCS_KEY}; {fix}"]
    bad = [i for i, w in enumerate(weights) if isinstance(w, bool) or not isinstance(w, (int, float))]
    bad += [i for i, w in enumerate(weights) if i not in bad and not math.isfinite(w)]
    return [f"{WEIGHTS_KEY}[{i}]: got {weights[i]!r}, expected a finite number" for i in bad]


def _unique_names(named: list[tuple[str, RewardFunc]]) -> list[tuple[str, RewardFunc]]:
    """Metric names must differ: a second `format` is `format_2`, a third `format_3`."""
    seen: collections.Counter[str] = collections.Counter()
    unique = []
    for name, func in named:
        seen[name] += 1
        unique.append((name if seen[name] == 1 else f"{name}_{seen[name]}", func))
    return unique


def required_columns(rewards: Iterable[Reward]) -> dict[str, str]:
    """column -> the reward that reads it, for the built-ins that read a column (user functions
    declare none): so that a run checks its data before its first rollout."""
    needed: dict[str, str] = {}
    for reward in rewards:
        column = getattr(reward.func, "column", None)
        if isinstance(reward.func, tuple(BUILTIN_REWARDS.values())) and isinstance(column, str):
            needed.setdefault(column, reward.name)
    return needed


def check_columns(rewards: Iterable[Reward], columns: Iterable[str], key: str = "data.train") -> None:
    """A RecipeError naming each column a built-in reward reads that the data lacks, and the fix."""
    present = set(columns)
    missing = {c: name for c, name in required_columns(rewards).items() if c not in present}
    known = ", ".join(sorted(present)) or "none"
    raise_if = [
        f"{key}: reward `{name}` reads column `{column}`, which the data lacks (columns: {known}); "
        f"set its option `column`, or add the column"
        for column, name in missing.items()
    ]
    if raise_if:
        raise RecipeError(*raise_if)


# --- scoring ----------------------------------------------------------------------------------------


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]],
    rows: Sequence[int] | None = None,
    completion_ids: Sequence[Sequence[int]] | None = None,
) -> Scores:
    """Call each reward function as TRL's GRPOTrainer does and weigh the results as it does: None
    becomes NaN, and a completion's total is the weighted sum over the functions that scored it
    (`nansum`), NaN when none did. `columns` are the dataset's other columns, aligned with the
    completions, and `rows` each completion's dataset row (for errors; default: its position).
    A function that raises, or returns the wrong count, a non-number, NaN or an infinity, stops
    with a RewardError: one line naming the function and the row."""
    count = len(completions)
    rows = list(rows) if rows is not None else list(range(count))
    kwargs = _call_arguments(prompts, completions, columns, completion_ids)
    if len(rows) != count or any(len(v) != count for v in kwargs.values()):
        raise ValueError("prompts, completions, rows and every column must have one entry per completion")
    per_function = [_checked(reward, kwargs, rows) for reward in rewards]
    matrix = [list(values) for values in zip(*per_function)] if per_function else [[] for _ in range(count)]
    return Scores(matrix, [_weighted_total(values, rewards) for values in matrix])


def _call_arguments(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]],
    completion_ids: Sequence[Sequence[int]] | None,
) -> dict[str, list[Any]]:
    kwargs = {k: list(v) for k, v in columns.items() if k not in NOT_COLUMNS}
    kwargs.update(prompts=list(prompts), completions=list(completions))
    if completion_ids is not None:
        kwargs["completion_ids"] = [list(ids) for ids in completion_ids]
    return kwargs


def _weighted_total(values: list[float], rewards: Sequence[Reward]) -> float:
    scored = [r.weight * v for v, r in zip(values, rewards) if not math.isnan(v)]
    return math.fsum(scored) if scored else math.nan


def _checked(reward: Reward, kwargs: dict[str, list[Any]], rows: list[int]) -> list[float]:
    """One function's rewards for every completion, None as NaN; RewardError naming the row otherwise."""
    count = len(rows)
    try:
        returned = reward.func(**kwargs)
    except Exception as e:
        row = _failing_row(reward.func, kwargs, rows)
        where = f"dataset row {row}" if row is not None else f"a batch of {_span(rows)}"
        raise RewardError(f"reward `{reward.name}` failed on {where}: {type(e).__name__}: {first_line(e)}") from e
    if isinstance(returned, (str, bytes, Mapping)) or not isinstance(returned, Iterable):
        raise RewardError(
            f"reward `{reward.name}` returned a {type(returned).__name__} for {_span(rows)}; "
            "return a list with one float or None per completion"
        )
    values = list(returned)
    if len(values) != count:
        raise RewardError(
            f"reward `{reward.name}` returned {len(values)} rewards for {count} completions "
            f"({_span(rows)}); return one float or None per completion"
        )
    return [_as_reward(value, reward.name, row) for value, row in zip(values, rows)]


def _span(rows: list[int]) -> str:
    return f"dataset rows {min(rows)}..{max(rows)}" if rows else "no rows"


def _as_reward(value: Any, name: str, row: int) -> float:
    if value is None:
        return math.nan
    if isinstance(value, (str, bytes)) or not _is_real(value):
        raise RewardError(f"reward `{name}` returned {value!r} on dataset row {row}; return a float or None")
    number = float(value)
    if not math.isfinite(number):
        raise RewardError(
            f"reward `{name}` returned {number} on dataset row {row}; return a finite float, or None to skip the row"
        )
    return number


def _is_real(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _failing_row(func: RewardFunc, kwargs: dict[str, list[Any]], rows: list[int]) -> int | None:
    """The first row whose completion alone makes `func` raise (None when only the whole batch does)."""
    for i, row in enumerate(rows):
        try:
            func(**{k: v[i : i + 1] for k, v in kwargs.items()})
        except Exception:
            return row
    return None
