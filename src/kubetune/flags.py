"""Settings declared once, as dataclass fields, and the typer options generated from them.

A settings class (`kubetune.k8s.serve.ServeSettings`, `kubetune.cluster.manifests.ComponentSettings`)
declares each field with `setting(default, flag, help)`: the default lives on the field, the flag
and its help in the field's `Option`. `with_options` then gives a command one option per field,
so a new setting is one field and its flag cannot restate (and drift from) its default.

Two ways to pass the values on, by what the command needs:
- `defaults="settings"`: each option's default is the field's, shown in `--help`; the command
  receives every value (`settings_from` builds the settings from them), or with `build=True`
  the settings themselves;
- `defaults="given"`: each option defaults to None (a switch to False), so the command can tell
  which flags were given (`is_given`) and the settings' own defaults apply to the others.

Typer and the standard library only: every layer's CLI may import it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import typer


@dataclass(frozen=True)
class Option:
    """How one setting is given on the command line: its flag (`--watch-pods/--stateless` for a
    switch with both names), an optional short name, its help, an environment variable it is read
    from; and, for a setting a FineTune takes too, its key under `spec.serve` with the CRD's
    description (a minimum for an integer, the choices of a string)."""

    flag: str
    help: str
    short: str | None = None
    envvar: str | None = None
    spec_key: str | None = None
    spec_help: str = ""
    minimum: int | None = None
    choices: tuple[str, ...] = ()


def setting(default: Any, flag: str, help: str, **option: Any) -> Any:
    """A settings field: its default, and the `Option` its flag is made from."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("a mutable default would be shared: use a tuple")
    return field(default=default, metadata={"option": Option(flag, help, **option)})


def options_of(settings: type) -> list[tuple[dataclasses.Field[Any], Option]]:
    """Every setting's field with its Option, in the order of the command line (fields without
    an Option are not flags)."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(settings) if "option" in f.metadata]


def scalar_type(settings: type, f: dataclasses.Field[Any]) -> type:
    """What a setting holds, None aside: bool, int, float, str, Path-like, or tuple (repeatable)."""
    kind = get_type_hints(settings)[f.name]
    if get_origin(kind) is tuple:
        return tuple
    if get_origin(kind) in (Union, UnionType):  # X | None
        (kind,) = [arg for arg in get_args(kind) if arg is not type(None)]
    return kind if isinstance(kind, type) else str


def is_given(value: Any) -> bool:
    """A flag's value says it was given: not None, not a switch left off, not an empty list."""
    return value is not None and value is not False and value != [] and value != ()


def _parameter(
    settings: type, f: dataclasses.Field[Any], option: Option, defaults: str, panel: str | None
) -> inspect.Parameter:
    kind = scalar_type(settings, f)
    default: Any
    annotation: Any = list[str] if kind is tuple else kind
    if defaults == "given":
        default = False if kind is bool else None
        annotation = annotation if kind is bool else annotation | None
    else:
        default = f.default
        default = list(default) if kind is tuple else default
        annotation = annotation | None if f.default is None or kind is tuple else annotation
    names = (option.flag, option.short) if option.short else (option.flag,)
    info = typer.Option(default, *names, help=option.help or None, envvar=option.envvar, rich_help_panel=panel)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def with_options(
    settings: type,
    into: str,
    *,
    defaults: Literal["settings", "given"] = "settings",
    panel: str | None = None,
    after: tuple[str, ...] = (),
    build: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command: one option per field of `settings`, after the command's own options
    (but for those named in `after`, which follow them); the command receives them as `into`
    (field -> the value given), or with `build` the settings made from them."""
    assert not build or defaults == "settings", "only every flag's value makes the settings"

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(command, eval_str=True)
        added = [_parameter(settings, f, option, defaults, panel) for f, option in options_of(settings)]
        names = [p.name for p in added]
        assert not set(names) & set(own.parameters), f"a field of {settings.__name__} shadows a parameter"

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in names}
            return command(**kwargs, **{into: settings_from(settings, values) if build else values})

        kept = [p for p in own.parameters.values() if p.name != into]
        last = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in kept if p.name in after]
        first = [p for p in kept if p.name not in after]
        run.__signature__ = own.replace(parameters=[*first, *added, *last])  # type: ignore[attr-defined]
        return run

    return decorate


def settings_from(settings: type, values: dict[str, Any]) -> Any:
    """The settings from every flag's value (`defaults="settings"`): repeatable flags as tuples."""
    fields = {f.name: f for f, _ in options_of(settings)}
    converted = {
        name: tuple(value or ()) if scalar_type(settings, fields[name]) is tuple else value
        for name, value in values.items()
    }
    return settings(**converted)
