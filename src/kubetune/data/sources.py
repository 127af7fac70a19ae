"""Where rows come from: builtin samples, local json/jsonl/csv/parquet files, or the hub.

Output is a list of plain dicts in one of two shapes, whatever the source's columns:
`{"instruction", "input", "output"}` or `{"messages": [{"role", "content"}, ...]}`.
Preference rows (`map_pair_columns`) have `chosen` and `rejected` answers (text) instead of
the output, and their messages are the prompt turns alone: `{"instruction", "input",
"chosen", "rejected"}` or `{"messages", "chosen", "rejected"}`. So kubetune's own pair files
(an SFT row's columns with `chosen`/`rejected` for `output`), TRL's `{"prompt", "chosen",
"rejected"}` (`data.columns.instruction=prompt`, or `data.columns.messages=prompt` when the
prompt is a conversation) and chat rows whose answers are lists of one assistant message all
map through the same column map as SFT.
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

from kubetune.data.templates import ANSWERS, Message, Row
from kubetune.errors import DataError
from kubetune.recipe.schema import ColumnsSection

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def builtin_dataset(name: str) -> Path:
    root = importlib.resources.files("kubetune.data") / "samples"
    path = Path(str(root / f"{name}.jsonl"))
    if not path.is_file():
        known = sorted(p.name[:-6] for p in root.iterdir() if p.name.endswith(".jsonl"))
        raise DataError(f"data.train: unknown builtin dataset `{name}`; known: {', '.join(known)}")
    return path


def _load_local(path: Path, key: str) -> list[Row]:
    fmt = LOCAL_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(
            f"{key}: unsupported file type {path.suffix or '(none)'} for {path}; use one of {', '.join(LOCAL_FORMATS)}"
        )
    if fmt == "json":
        return _read_json_rows(path, key)
    from datasets import load_dataset

    try:
        ds = load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # pyarrow raises many types for malformed files
        raise DataError(f"{key}: cannot read {path} as {fmt} ({str(e).splitlines()[0][:200]})") from None
    rows: list[Row] = ds.to_list()
    return rows


def _read_json_rows(path: Path, key: str) -> list[Row]:
    """JSON Lines, or a JSON array of objects (what `datasets` accepts), read without pyarrow
    so that a bad line is reported with its number."""
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    rows: list[Row]
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{key}: {path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    else:
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{key}: {path} line {lineno} is not valid JSON ({e.msg})") from None
    if not all(isinstance(r, dict) for r in rows):
        raise DataError(f"{key}: {path} must hold JSON objects, one row each")
    return rows


def _load_hub(name: str, split: str, key: str) -> list[Row]:
    from datasets import load_dataset

    try:
        ds = load_dataset(name, split=split)
    except Exception as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise DataError(
            f"{key}: cannot load hub dataset `{name}` split `{split}` ({first}); "
            f"offline? give a local json/jsonl/csv/parquet path instead"
        ) from None
    rows: list[Row] = ds.to_list()
    return rows


def load_rows(spec: str, split: str, key: str) -> list[Row]:
    """Read raw rows. `key` names the recipe field for error messages."""
    if spec.startswith("builtin:"):
        return _load_local(builtin_dataset(spec.split(":", 1)[1]), key)
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir():
            raise DataError(f"{key}: {path} is a directory; point it at a json/jsonl/csv/parquet file")
        return _load_local(path, key)
    if path.suffix.lower() in LOCAL_FORMATS or spec.startswith((".", "/", "~")):
        raise DataError(f"{key}: file not found: {path}")
    return _load_hub(spec, split, key)


def map_columns(rows: list[Row], columns: ColumnsSection, key: str) -> list[Row]:
    """Rename the recipe's columns to the canonical shape; fail naming the missing column."""
    present = _columns_of(rows, key)
    if columns.messages:
        return [{"messages": m} for m in message_lists(rows, columns.messages, present, key)]
    prompts = prompt_fields(rows, columns, present, key)
    output_col = _required(key, "output", columns.output, present)
    return [{**prompt, "output": str(r.get(output_col) or "")} for prompt, r in zip(prompts, rows)]


def map_pair_columns(rows: list[Row], columns: ColumnsSection, key: str) -> list[Row]:
    """Preference rows in the canonical shape (the prompt mapped as `map_columns` maps it, then
    the two answers); one error naming the row, the column and the fix for a bad pair."""
    present = _columns_of(rows, key)
    answer_cols = {a: _required(key, a, getattr(columns, a), present) for a in ANSWERS}
    if columns.messages:
        prompts: list[Row] = []
        for i, msgs in enumerate(message_lists(rows, columns.messages, present, key)):
            if msgs[-1]["role"] == "assistant":
                raise DataError(
                    f"{key}: row {i}: column `{columns.messages}` ends with an assistant turn; in preference "
                    f"rows it holds the prompt turns only and the answers go in `{answer_cols['chosen']}` and "
                    f"`{answer_cols['rejected']}`"
                )
            prompts.append({"messages": msgs})
    else:
        prompts = prompt_fields(rows, columns, present, key)
    out: list[Row] = []
    for i, (prompt, r) in enumerate(zip(prompts, rows)):
        answers = {
            a: _answer(r.get(col), f"{key}: row {i}: column `{col}` (data.columns.{a})")
            for a, col in answer_cols.items()
        }
        if answers["chosen"] == answers["rejected"]:
            raise DataError(
                f"{key}: row {i}: columns `{answer_cols['chosen']}` and `{answer_cols['rejected']}` hold the same "
                f"answer; a pair needs two different answers: fix the row or drop it"
            )
        out.append({**prompt, **answers})
    return out


def _columns_of(rows: list[Row], key: str) -> set[str]:
    if not rows:
        raise DataError(f"{key}: the dataset is empty; give a file with at least one row")
    return set(rows[0])


def message_lists(rows: list[Row], col: str, present: set[str], key: str) -> list[list[Message]]:
    """Each row's conversation in column `col` (data.columns.messages), as {role, content} messages."""
    if col not in present:
        raise DataError(_missing(key, "messages", col, present))
    out: list[list[Message]] = []
    for i, r in enumerate(rows):
        msgs = r.get(col)
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise DataError(f"{key}: row {i}: column `{col}` must be a list of {{role, content}} messages")
        out.append([{"role": m.get("role"), "content": m.get("content") or ""} for m in msgs])
    return out


def prompt_fields(rows: list[Row], columns: ColumnsSection, present: set[str], key: str) -> list[Row]:
    """Each row's `{instruction, input}`."""
    in_col = columns.input if columns.input in present else None
    # data with only a question column (input + output) is fine: the templates use the input
    # as the question; only a dataset with neither column has nothing to ask
    instruction_col = columns.instruction if columns.instruction in present else None
    if instruction_col is None and in_col is None:
        raise DataError(_missing(key, "instruction", columns.instruction, present))
    return [
        {
            "instruction": str(r.get(instruction_col) or "") if instruction_col else "",
            "input": str(r.get(in_col) or "") if in_col else "",
        }
        for r in rows
    ]


def _answer(value: object, where: str) -> str:
    """A preference answer: text, or a list of one assistant message (TRL's conversational rows)."""
    if isinstance(value, list):
        if len(value) != 1 or not isinstance(value[0], dict) or value[0].get("role") != "assistant":
            raise DataError(f"{where} must be text or a list of one assistant message; put the answer there")
        value = value[0].get("content")
    if value is None or not str(value).strip():
        raise DataError(f"{where} is empty; every pair needs both answers: fill it in or drop the row")
    return str(value)


def _required(key: str, field: str, col: str | None, present: set[str]) -> str:
    """The column the recipe names for `field`, which must be in the dataset."""
    if col is None or col not in present:
        raise DataError(_missing(key, field, col, present))
    return col


def _missing(key: str, field: str, col: str | None, present: set[str]) -> str:
    return (
        f"{key}: column `{col}` (data.columns.{field}) is not in the dataset; its columns are "
        f"{', '.join(sorted(present))}: set data.columns.{field}=<one of them>"
    )
