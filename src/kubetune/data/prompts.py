"""Prompt-only data for online RL (finetune.objective = grpo).

A row gives a prompt and, beside it, whatever the reward functions read (an `answer`, a
schema, ...). The prompt is TRL's `prompt` column (text, or chat messages without the
assistant's turn) when the dataset has one (`data.columns.prompt`), else the instruction and
input columns as SFT maps them; it is rendered by the recipe's template exactly as SFT
renders a prompt. Every other column travels with the row, by its own name, to the rewards.

The prompts are held as `TokenizedData` samples with no target token, so that the epoch's
shuffle, the split between data-parallel processes and the resume position are the
`Batcher`'s, as in SFT: one of its "micro-batches" is one generation's prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kubetune.data.sources import message_lists, prompt_fields
from kubetune.data.templates import PromptRenderer, Row
from kubetune.data.tokenize import TokenizedData
from kubetune.errors import DataError
from kubetune.recipe.schema import ColumnsSection

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PROMPT_FIELDS = ("instruction", "input", "messages")  # what the renderer reads of a mapped row


@dataclass
class PromptSet:
    """One split's prompts: their tokens (samples), their text, and each row's other columns."""

    tokens: TokenizedData
    texts: list[str]
    columns: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.texts)


def map_prompt_rows(rows: list[Row], columns: ColumnsSection, key: str) -> list[Row]:
    """Rows as `{instruction, input}` or `{messages}` plus `columns` (the rest, for rewards)."""
    if not rows:
        raise DataError(f"{key}: the dataset is empty; give a file with at least one row")
    prompt_col = columns.prompt
    if prompt_col and prompt_col in rows[0]:
        mapped = [_prompt_row(r.get(prompt_col), f"{key}: row {i}: column `{prompt_col}`") for i, r in enumerate(rows)]
        used = {prompt_col}
    elif columns.messages:
        where = f"{key}: column `{columns.messages}`"
        mapped = [_prompt_row(m, where) for m in message_lists(rows, columns.messages, set(rows[0]), key)]
        used = {columns.messages}
    else:
        mapped = prompt_fields(rows, columns, set(rows[0]), key)
        used = {c for c in (columns.instruction, columns.input) if c}
    return [{**m, "columns": {k: v for k, v in r.items() if k not in used}} for m, r in zip(mapped, rows)]


def _prompt_row(value: object, where: str) -> Row:
    """TRL's `prompt`: text, or a conversation that does not end with the assistant's turn."""
    if isinstance(value, str) and value.strip():
        return {"instruction": value, "input": ""}
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        if value[-1].get("role") == "assistant":
            raise DataError(f"{where} ends with an assistant turn; a prompt holds the turns before the answer")
        return {"messages": [{"role": m.get("role"), "content": m.get("content") or ""} for m in value]}
    raise DataError(f"{where} must be text or a list of {{role, content}} messages")


def tokenize_prompts(
    rows: list[Row], renderer: PromptRenderer, tokenizer: PreTrainedTokenizerBase, max_prompt_tokens: int, key: str
) -> PromptSet:
    """Render and tokenize each prompt; one that leaves no room for its completion is an error."""
    texts = [renderer.prompt({k: v for k, v in r.items() if k in PROMPT_FIELDS}) for r in rows]
    ids: list[list[int]] = tokenizer(texts, add_special_tokens=not renderer.uses_chat_template)["input_ids"]
    for i, p in enumerate(ids):
        if len(p) > max_prompt_tokens:
            raise DataError(
                f"{key}: row {i}: the prompt has {len(p)} tokens, and data.max_seq_len minus "
                f"finetune.rl.max_completion_length leaves {max_prompt_tokens}; raise data.max_seq_len or shorten "
                f"the prompt"
            )
    lengths = np.asarray([len(p) for p in ids], dtype=np.int64)
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    flat = np.asarray([t for p in ids for t in p], dtype=np.int32)
    tokens = TokenizedData(flat, np.zeros(len(flat), dtype=bool), offsets)
    return PromptSet(tokens, texts, [dict(r["columns"]) for r in rows])
