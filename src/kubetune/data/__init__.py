"""Data: sources -> column mapping -> prompt template -> tokens (cached) -> packed micro-batches.

With a preference objective (finetune.objective != sft) the rows are pairs (prompt, chosen,
rejected) and so is everything downstream: `TokenizedData.pairs` (sample 2k = pair k's prompt +
chosen answer, 2k+1 = prompt + rejected answer), the eval split (pairs are held out whole) and
the batches (a pair is never split; `Batch.chosen` / `rejected` / `pair_ids`). The eval rows
kept for sample answers are the SFT rows of the chosen answers, the reference outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kubetune.data.packing import Batch, Batcher
from kubetune.data.prompts import PROMPT_FIELDS, PromptSet, map_prompt_rows, tokenize_prompts
from kubetune.data.sources import load_rows, map_columns, map_pair_columns
from kubetune.data.templates import PromptRenderer, Row, pair_sequences
from kubetune.data.tokenize import TokenizedData, cache_key, load_or_build, tokenize_pairs, tokenize_rows
from kubetune.errors import DataError
from kubetune.fsutil import cache_root
from kubetune.recipe.schema import ColumnsSection, Recipe

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Batch", "Batcher", "PreparedData", "PromptRenderer", "prepare_data"]

EVAL_SPLIT_SEED = 1234  # fixed, so the held-out rows don't move when train.seed changes


@dataclass
class PreparedData:
    train: TokenizedData
    eval: TokenizedData | None
    eval_rows: list[Row]  # raw eval rows (of pairs: with the chosen answer as output), for generation samples
    renderer: PromptRenderer
    # grpo: the prompts with the columns their rewards read (`train` and `eval` are their tokens)
    prompts: PromptSet | None = None
    eval_prompts: PromptSet | None = None


def split_rows(rows: list[Row], fraction: float) -> tuple[list[Row], list[Row]]:
    n_eval = max(1, round(len(rows) * fraction))
    if n_eval >= len(rows):
        raise DataError(f"data.eval={fraction} holds out all {len(rows)} rows; use a smaller fraction")
    perm = np.random.default_rng(EVAL_SPLIT_SEED).permutation(len(rows))
    held = set(perm[:n_eval].tolist())
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


RowMapper = Callable[[list[Row], ColumnsSection, str], list[Row]]


def mapped_splits(recipe: Recipe, mapped: RowMapper) -> tuple[list[Row], list[Row]]:
    """The training rows and the held-out rows (a fraction of train, or a file), in the canonical shape."""
    d = recipe.data
    rows = mapped(load_rows(d.train, d.split, "data.train"), d.columns, "data.train")
    eval_rows: list[Row] = []
    if isinstance(d.eval, float):
        rows, eval_rows = split_rows(rows, d.eval)
    elif isinstance(d.eval, str):
        eval_rows = mapped(load_rows(d.eval, "test", "data.eval"), d.columns, "data.eval")
    if d.max_train_samples:
        rows = rows[: d.max_train_samples]
    if d.max_eval_samples:
        eval_rows = eval_rows[: d.max_eval_samples]
    return rows, eval_rows


def prepare_prompts(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> PreparedData:
    """grpo: prompt rows and their columns; the held-out rows' `answer` is their sample answers' reference."""
    d = recipe.data
    rows, eval_rows = mapped_splits(recipe, map_prompt_rows)
    renderer = PromptRenderer(d.template, tokenizer, d.system_prompt)
    room = d.max_seq_len - recipe.finetune.rl.max_completion_length
    if room < 1:
        raise DataError(
            f"data.max_seq_len={d.max_seq_len} leaves no room for a prompt before "
            f"finetune.rl.max_completion_length={recipe.finetune.rl.max_completion_length}; raise data.max_seq_len"
        )
    train = tokenize_prompts(rows, renderer, tokenizer, room, "data.train")
    held = tokenize_prompts(eval_rows, renderer, tokenizer, room, "data.eval") if eval_rows else None
    references = [
        {**{k: v for k, v in r.items() if k in PROMPT_FIELDS}, "output": str(r["columns"].get("answer", ""))}
        for r in eval_rows
    ]
    return PreparedData(
        train=train.tokens,
        eval=held.tokens if held else None,
        eval_rows=references,
        renderer=renderer,
        prompts=train,
        eval_prompts=held,
    )


def prepare_data(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> PreparedData:
    if recipe.finetune.objective == "grpo":
        return prepare_prompts(recipe, tokenizer)
    d = recipe.data
    pairs = recipe.finetune.on_pairs
    rows, eval_rows = mapped_splits(recipe, map_pair_columns if pairs else map_columns)
    renderer = PromptRenderer(d.template, tokenizer, d.system_prompt)
    cache_dir = Path(d.cache_dir) if d.cache_dir else cache_root() / "data"

    tokenize = tokenize_pairs if pairs else tokenize_rows

    def tokenized(part: list[Row], key: str) -> TokenizedData:
        # the template as rendered: `auto` keys as what it chose, so an explicit chat or alpaca keeps its key
        k = cache_key(part, tokenizer, renderer.template, d.system_prompt, d.max_seq_len, d.truncate, pairs)
        return load_or_build(
            cache_dir, k, lambda: tokenize(part, renderer, tokenizer, d.max_seq_len, d.truncate, key), pairs
        )

    train = tokenized(rows, "data.train")
    if int(train.trainable.sum()) == 0:
        raise DataError("data.train: no row has a non-empty answer to train on; check data.columns.output")
    ev = tokenized(eval_rows, "data.eval") if eval_rows else None
    if pairs:  # sample answers are scored against the chosen one
        eval_rows = [pair_sequences(r)[0] for r in eval_rows]
    return PreparedData(train=train, eval=ev, eval_rows=eval_rows, renderer=renderer)
