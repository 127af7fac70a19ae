"""Error types shared by every layer.

A `UserError` is something the user can fix (bad recipe key, missing file, impossible
resources). The CLI prints it as one line per problem on stderr and exits with code 2,
without a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in the user's input. `problems` holds one line per problem."""

    exit_code = 2

    def __init__(self, *problems: str) -> None:
        self.problems = [p for p in problems if p] or ["unknown error"]
        super().__init__("\n".join(self.problems))


class RecipeError(UserError):
    """The recipe (YAML + overrides) is invalid."""


class DataError(UserError):
    """The dataset cannot be loaded or does not match the recipe."""


class ModelError(UserError):
    """The model cannot be loaded or does not match the recipe."""


class RunDirError(UserError):
    """The output directory belongs to another run, or is missing what a command needs."""


class MemoryBudgetError(UserError):
    """The run outgrew KUBETUNE_MEMORY_BUDGET; a checkpoint was saved first."""


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (its type where it has none): what a
    one-line error quotes of a library's multi-line error."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
