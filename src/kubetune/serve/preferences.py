"""`kubetune data make-preferences`: preference pairs from a recipe's supervised data.

Each row's reference answer is the chosen answer; the rejected one is the recipe's base model's
own greedy answer to the same prompt, as self-play preference methods (SPIN) build their pairs,
so that DPO moves the model from what it says now towards the reference. The prompt is the one
training renders (the recipe's column map, template and system prompt), and the answers come
from the serving engine (engine/core.py: continuous batching over a KV cache), so a pair costs one
batched decode rather than one `generate` call. Greedy decoding makes the file reproducible.

Rows whose greedy answer already is the reference teach nothing and are left out, as are rows
without a reference answer and empty greedy answers (a pair needs two different answers, which
the preference data reader checks); the summary counts each. The file is ordinary JSON Lines
in kubetune's own column names (the instruction and input of the source row, or its chat
history, beside `chosen` and `rejected`), so a DPO recipe reads it with the default
`data.columns`.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kubetune.contracts.engine import Event, Limits, Request, Sampling
from kubetune.data.sources import load_rows, map_columns
from kubetune.data.templates import PromptRenderer, Row
from kubetune.engine.core import Engine
from kubetune.engine.kvcache import SlotCache, register
from kubetune.engine.lora import install
from kubetune.errors import UserError
from kubetune.fsutil import atomic_write_text
from kubetune.models.kernels import compute_precision
from kubetune.models.load import DTYPES, model_config
from kubetune.models.runs import load_run
from kubetune.recipe import Recipe, load_recipe
from kubetune.serve.native import host
from kubetune.serve.native.build import kv_budget
from kubetune.serve.native.metrics import ServeMetrics

# Sequences decoded together: a CPU decode step reads every weight once whatever the batch, so
# a larger batch is nearly free per answer until the KV cache no longer fits (the engine then
# admits fewer); the serving default, as `kubetune serve --max-num-seqs`.
BATCH = Limits().max_num_seqs
PROGRESS_STEPS = 20  # progress lines over a whole run (off a terminal)


@dataclass(frozen=True)
class Pair:
    """One source row's prompt fields, its reference answer and the model's greedy answer."""

    prompt_fields: Row  # {"instruction", "input"} or {"messages"}: the row without its answer
    chosen: str
    rejected: str

    def row(self) -> Row:
        return {**self.prompt_fields, "chosen": self.chosen, "rejected": self.rejected}

    @property
    def left_out(self) -> str | None:
        """Why this pair is not written (a LEFT_OUT key), or None."""
        if not self.chosen:
            return "no_reference"
        if not self.rejected:
            return "empty"
        return "identical" if self.rejected == self.chosen else None


# why a pair is left out -> how the summary line says it
LEFT_OUT = {
    "identical": "whose greedy answer equals the reference",
    "no_reference": "without a reference answer",
    "empty": "whose greedy answer is empty",
}


@dataclass(frozen=True)
class Made:
    """What one run of make-preferences wrote, for its summary line."""

    out: Path
    rows: int
    written: int
    left_out: dict[str, int]  # LEFT_OUT key -> pairs
    seconds: float

    def summary(self) -> str:
        reasons = ", ".join(f"{self.left_out.get(k, 0)} {says}" for k, says in LEFT_OUT.items())
        return (
            f"wrote {self.written} preference pairs to {self.out} from {self.rows} rows; left out {reasons} "
            f"({self.seconds:.0f} s)"
        )


def make_preferences(
    recipe: str | None,
    overrides: list[str],
    out: Path,
    limit: int | None = None,
    max_new_tokens: int = 128,
    echo: Callable[[str], None] = print,
    console: Any = None,
) -> Made:
    """Read the recipe's training rows, answer each greedily with its base model, write the pairs.
    Progress: through `echo` one line per phase and per twentieth of the rows, or with `console` (a
    rich Console on a terminal) one bar through every phase (`Progress`)."""
    started = time.monotonic()
    check_out(out)
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit}: must be at least 1 (or leave it out for every row)")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    r = load_recipe(recipe, overrides).recipe
    rows = source_rows(r, limit)  # a bad data.train: its one error line, before any progress
    with Progress(echo, console) as progress:
        greedy = answer(r, rows, max_new_tokens, progress)
    pairs = [Pair(prompt_fields(row), reference(row), text) for row, text in zip(rows, greedy)]
    kept = [p for p in pairs if p.left_out is None]
    atomic_write_text(out, "".join(json.dumps(p.row(), ensure_ascii=False) + "\n" for p in kept))
    left_out = Counter(p.left_out for p in pairs if p.left_out is not None)
    return Made(out, len(rows), len(kept), dict(left_out), time.monotonic() - started)


def check_out(out: Path) -> None:
    """--out must be a file this process can write: refused before any model loads."""
    if out.is_dir():
        raise UserError(f"--out {out}: is a directory; give a file name (e.g. {out / 'preferences.jsonl'})")
    if out.suffix.lower() != ".jsonl":
        raise UserError(f"--out {out}: the pairs are JSON Lines; give a file name ending in .jsonl")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create its folder ({e.strerror}); choose a writable path") from None


def source_rows(recipe: Recipe, limit: int | None) -> list[Row]:
    """The recipe's training rows as training maps them (its column map); the first `limit`."""
    d = recipe.data
    raw = load_rows(d.train, d.split, "data.train")
    present = set(raw[0]) if raw else set()
    if {d.columns.chosen, d.columns.rejected} <= present and d.columns.output not in present:
        raise UserError(
            f"data.train={d.train} holds preference pairs already ({d.columns.chosen}, {d.columns.rejected}); "
            "make-preferences reads answered rows: give data.train=<them>, e.g. "
            "data.train=builtin:medical_flashcards_sample"
        )
    rows = map_columns(raw, d.columns, "data.train")
    return rows[:limit] if limit else rows


def prompt_fields(row: Row) -> Row:
    """The row without its answer: instruction and input, or the chat history before the answer."""
    if "messages" in row:
        msgs = row["messages"]
        return {"messages": msgs[:-1] if msgs[-1]["role"] == "assistant" else msgs}
    return {"instruction": row["instruction"], "input": row["input"]}


def reference(row: Row) -> str:
    """The row's reference answer: its output, or the chat's final assistant message."""
    if "messages" in row:
        last = row["messages"][-1]
        return str(last["content"]).strip() if last["role"] == "assistant" else ""
    return str(row["output"]).strip()


def answer(recipe: Recipe, rows: list[Row], max_new_tokens: int, progress: Progress) -> list[str]:
    """The base model's greedy answer to each row's prompt, rendered as training renders it, on
    `train.num_threads` threads (else the container's CPU quota, as serving runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.train.num_threads or host.threads())
    try:
        progress.phase(f"loading {recipe.model.name_or_path} ({len(rows)} rows to answer)")
        lm, tokenizer, dtype = load_base(recipe)
        renderer = PromptRenderer(recipe.data.template, tokenizer, recipe.data.system_prompt)
        special = not renderer.uses_chat_template  # a chat template holds its special tokens already
        prompts = [tokenizer(renderer.prompt(row), add_special_tokens=special)["input_ids"] for row in rows]
        answers = greedy_answers(lm, tokenizer.eos_token_id, dtype, prompts, max_new_tokens, progress)
    finally:
        torch.set_num_threads(threads)
    return [tokenizer.decode(a, skip_special_tokens=True).strip() for a in answers]


def load_base(recipe: Recipe) -> tuple[Any, Any, torch.dtype]:
    """The recipe's base model (its revision and remote code), in the precision training measures
    for it on this CPU, with the engine's attention over the slot cache."""
    cpu = torch.device("cpu")
    precision = compute_precision(recipe.train.precision, model_config(recipe.model), cpu)
    dtype = DTYPES[recipe.with_kernels(precision, "fp32").base_dtype_name()]
    lm, tokenizer = load_run(recipe, dtype=dtype, attn=register())
    lm.eval()
    return lm, tokenizer, dtype


def greedy_answers(
    lm: Any,
    eos: int,
    dtype: torch.dtype,
    prompts: list[list[int]],
    max_new_tokens: int,
    progress: Progress,
) -> list[list[int]]:
    """The greedy answer tokens of every prompt, decoded by the serving engine on this thread."""
    # plain weights: serving's oneDNN packing is chosen by a race at start-up that pays off over a
    # server's hours, and has not been measured against a run of one file
    limits = fitting_limits(lm.config, prompts, max_new_tokens)
    cache = SlotCache.for_config(lm.config, dtype, kv_budget(None))
    engine = Engine(lm, eos, cache, install(lm, []), limits, ServeMetrics("make-preferences", 0, []))
    tracker = Tracker(len(prompts), engine, progress)
    for i, prompt in enumerate(prompts):
        engine.submit(Request(f"row-{i}", prompt, Sampling(max_tokens=max_new_tokens), tracker.sink(i)))
    engine.run()  # returns once the last answer is in (Tracker stops the engine)
    if engine.error is not None or tracker.errors:
        raise RuntimeError(f"the engine failed while answering: {engine.error or tracker.errors[0]}")
    return tracker.answers


def fitting_limits(config: Any, prompts: list[list[int]], max_new_tokens: int) -> Limits:
    """Engine limits that take every prompt at once; a prompt too long for the model is refused
    here, naming its row, rather than by the engine."""
    context = int(getattr(config, "max_position_embeddings", 0) or Limits().max_model_len)
    for i, prompt in enumerate(prompts):
        if len(prompt) + max_new_tokens > context:
            raise UserError(
                f"data.train row {i}: the prompt ({len(prompt)} tokens) plus --max-new-tokens {max_new_tokens} "
                f"is more than the model's context of {context} tokens; lower --max-new-tokens or drop the row"
            )
    return Limits(
        max_num_seqs=BATCH,
        max_waiting=max(len(prompts), 1),
        max_model_len=context,
        max_prompt_tokens=context,
        prefix_caching=False,  # every prompt is asked once
    )


class Progress:
    """What make-preferences shows while it works. Loading the model comes before the first answer
    and can take a minute, so every phase shows: on a terminal one rich bar on stderr (pulsing
    while the model loads, then the rows answered, with the time left); elsewhere (a log, CI, a
    pod) a line per phase and per twentieth of the rows, through `echo`, as training prints its
    progress line off a terminal."""

    def __init__(self, echo: Callable[[str], None], console: Any = None) -> None:
        self.echo, self.console = echo, console
        self.total, self.every = 0, 1
        self.started = time.monotonic()
        self._bar: Any = None

    def __enter__(self) -> Progress:
        if self.console is not None:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            columns = (TextColumn("make-preferences: {task.description}"), BarColumn(), MofNCompleteColumn())
            self._bar = Bar(*columns, TimeElapsedColumn(), TimeRemainingColumn(), console=self.console)
            self._task = self._bar.add_task("", total=None, start=False)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def phase(self, what: str) -> None:
        """A phase without a count yet (loading the model)."""
        if self._bar is None:
            self.echo(f"make-preferences: {what} ({time.monotonic() - self.started:.0f} s)")
            return
        self._bar.update(self._task, description=what)
        self._show()

    def answering(self, total: int) -> None:
        self.total, self.every = total, max(1, total // PROGRESS_STEPS)
        if self._bar is None:
            self.phase(f"answering {total} rows")
            return
        self._bar.reset(self._task, description=f"answering {total} rows", total=total)
        self._show()

    def _show(self) -> None:
        """Draw the phase now, not at the bar's next tick (a phase may end before it)."""
        if not self._bar.live.is_started:  # started on the first phase: never drawn without one
            self._bar.start()
            self._bar.start_task(self._task)
        self._bar.refresh()

    def answered(self, done: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
        elif done % self.every == 0 or done == self.total:
            elapsed = time.monotonic() - self.started
            self.echo(f"make-preferences: {done}/{self.total} answered ({elapsed:.0f} s)")


class Tracker:
    """Collects each request's tokens, reports progress, and stops the engine when the last
    answer is complete. Its sinks run on the engine's thread, which is the caller's."""

    def __init__(self, total: int, engine: Engine, progress: Progress) -> None:
        self.total, self.engine, self.progress = total, engine, progress
        self.answers: list[list[int]] = [[] for _ in range(total)]
        self.errors: list[str] = []
        self.done = 0
        progress.answering(total)

    def sink(self, index: int) -> Callable[[Event], None]:
        def receive(event: Event) -> None:
            if event.token is not None:
                self.answers[index].append(event.token)
            if event.finish_reason is not None:
                self.finished(event)

        return receive

    def finished(self, event: Event) -> None:
        self.done += 1
        done = self.done
        if event.finish_reason == "error":
            self.errors.append(event.error or "unknown error")
        self.progress.answered(done)
        if done == self.total:
            self.engine.stop()
