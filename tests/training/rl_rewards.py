"""Reward functions the GRPO tests name by import path (`tests.training.rl_rewards:NAME`), with
TRL's signature: (prompts, completions, **columns) -> one float or None per completion."""

from __future__ import annotations

import os
from typing import Any


def even_tokens(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The share of a completion's tokens whose id is even: a signal a random tiny model can learn."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


_calls = {"n": 0}


def raises_later(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    """Scores by length until call KUBETUNE_TEST_RAISE_AT, then raises (on every process, or only
    on process KUBETUNE_TEST_RAISE_RANK while the others wait for it in the step's reductions)."""
    _calls["n"] += 1
    only_rank = os.environ.get("KUBETUNE_TEST_RAISE_RANK")  # set: only that process raises
    if only_rank is not None and os.environ.get("RANK", "0") != only_rank:
        return [float(len(c) % 3) for c in completions]
    if _calls["n"] >= int(os.environ.get("KUBETUNE_TEST_RAISE_AT", "1")):
        raise ZeroDivisionError("the grader divided by zero")
    return [float(len(c) % 3) for c in completions]
