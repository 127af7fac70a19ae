"""The start-up hint for GPU steps of several micro-batches: its fix must name overrides the
recipe loader accepts and that keep the step's rows (the same gradient), or say nothing."""

from __future__ import annotations

import pytest

from kubetune.recipe import load_recipe
from kubetune.recipe.layout import grad_accum_for
from kubetune.training.run import micro_batch_hint


def rows_per_step(overrides: list[str]) -> tuple[int, int]:
    train = load_recipe(None, overrides).recipe.train
    accum = grad_accum_for(train, data_parallel=1)
    return train.micro_batch_size * accum, accum


def fix_of(hint: str) -> list[str]:
    return [word for word in hint.split() if word.startswith("train.")]


@pytest.mark.parametrize(
    "given",
    [
        ["train.micro_batch_size=4", "train.grad_accum=2"],
        ["train.micro_batch_size=2", "train.grad_accum=8"],
        ["train.micro_batch_size=4", "train.grad_accum=1", "train.global_batch_size=32"],
    ],
)
def test_the_hint_computes_the_same_step_in_one_micro_batch(given):
    rows, accum = rows_per_step(given)
    train = load_recipe(None, given).recipe.train
    hint = micro_batch_hint("cuda", train.micro_batch_size, accum, train.global_batch_size is not None, False)
    assert hint is not None and f"{accum} of {train.micro_batch_size} rows" in hint
    assert rows_per_step([*given, *fix_of(hint)]) == (rows, 1)


@pytest.mark.parametrize(
    ("device", "accum", "scheduled"),
    [("cpu", 2, False), ("hpu", 2, False), ("cuda", 1, False), ("cuda", 4, True)],
)
def test_no_hint_off_cuda_for_one_micro_batch_or_a_scheduled_step(device, accum, scheduled):
    assert micro_batch_hint(device, 4, accum, False, scheduled) is None
