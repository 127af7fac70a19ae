"""The strict field types every request body of `kubetune serve` is built from.

Types are strict, as JSON states them: `true` is not a number, `"yes"` is not a boolean,
`1.5` is not a count. Text must be valid Unicode without NUL characters (a lone surrogate
such as `\\ud800` cannot be encoded, so no tokenizer can read it), and so must every key and
string inside a free-form JSON object (`JsonObject`: a schema, a tool's parameters, template
variables); every number must be finite. Unknown extra fields are accepted and ignored, as
vLLM does (e.g. `user`), so that clients written for OpenAI work unchanged; fields kubetune
knows and cannot honour are refused by name (protocol.py).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict


def _text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode (a lone surrogate such as \\ud800?)") from None
    if "\x00" in value:
        raise ValueError("holds a NUL character (\\u0000), which is not text")
    return value


def _json_text(value: dict[str, Any]) -> dict[str, Any]:
    """Every key and string inside a free-form JSON object (a schema, a tool's parameters,
    template variables) checked as `Text`: they reach the prompt and the grammar too."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            _named(path, item)
        elif isinstance(item, dict):
            for key, child in item.items():
                _named(f"{path}.{key}".lstrip("."), key)
                stack.append((f"{path}.{key}".lstrip("."), child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
    return value


def _named(path: str, text: str) -> None:
    try:
        _text(text)
    except ValueError as e:
        raise ValueError(f"{path}: {e}" if path else str(e)) from None


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


Text = Annotated[str, AfterValidator(_text)]
Finite = Annotated[float, AfterValidator(_finite)]
JsonObject = Annotated[dict[str, Any], AfterValidator(_json_text)]
STRICT = ConfigDict(extra="allow", strict=True)
