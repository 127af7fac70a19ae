"""`kubetune eval RUN --tasks a,b`: lm-eval-harness tasks on a run's base model and its tuned
model, side by side, through kubetune's engine (training/lmeval.py) and lm-eval's own
evaluator; the numbers go into the run's summary.json as `lm_eval: {task: {metric: {base, tuned}}}`.

`--tasks` takes lm-eval's task names (their data comes from the Hugging Face Hub, as with lm-eval
itself), kubetune's own offline tasks (`flashcards`, `flashcards_mc`), and paths to local task
YAML files or folders (lm-eval's TaskManager include_path).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetune.errors import UserError
from kubetune.fsutil import atomic_write_json
from kubetune.rundir import RunDir

log = logging.getLogger("kubetune")
SKIPPED_KEYS = ("alias", "name", "sample_len")  # lm-eval's per-task entries that are not metrics


@dataclass(frozen=True)
class TaskSpec:
    names: list[str]
    include: list[str]  # folders of local task YAMLs (with kubetune's own)
    field: str = "--tasks"  # what the user wrote them in, for error lines (or eval.tasks)


def parse_tasks(spec: str, field: str = "--tasks") -> TaskSpec:
    """--tasks: names, and YAML files or folders (a file's task is the `task:` it names)."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise UserError("lm-eval tasks need lm-eval-harness: pip install 'kubetune[eval]'")
    from kubetune.training.lmeval import shipped_tasks

    names, include = [], [str(shipped_tasks())]
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        path = Path(item).expanduser()
        looks_like_path = item.endswith((".yaml", ".yml")) or "/" in item or path.exists()
        if not looks_like_path:
            names.append(item)
            continue
        if not path.exists():
            raise UserError(f"{field} {item}: no such file or folder; give an lm-eval task name or a task YAML path")
        if path.is_dir():
            include.append(str(path))
            names += _yaml_tasks(sorted(path.glob("*.yaml")), field)
        else:
            include.append(str(path.parent))
            names += _yaml_tasks([path], field)
    if not names:
        raise UserError(f"{field}: name at least one task (e.g. flashcards,flashcards_mc)")
    return TaskSpec(names, include, field)


def _yaml_tasks(files: list[Path], field: str) -> list[str]:
    import yaml

    found = []
    for f in files:
        text = "\n".join(line for line in f.read_text().splitlines() if "!function" not in line)
        try:
            task = (yaml.safe_load(text) or {}).get("task")
        except yaml.YAMLError as e:
            raise UserError(f"{field} {f}: not a YAML file lm-eval can read ({str(e).splitlines()[0]})") from None
        if not task:
            raise UserError(f"{field} {f}: names no `task:`; an lm-eval task YAML names its task")
        found += task if isinstance(task, list) else [task]
    return found


def task_manager(spec: TaskSpec) -> Any:
    """lm-eval's TaskManager over its own tasks and `spec`'s folders; every name checked, and
    every task's data loaded once here, so a task that cannot be fetched stops with its name."""
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = TaskManager(include_path=spec.include)
    for name in spec.names:
        if name not in manager.all_tasks:
            raise UserError(
                f"{spec.field} {name}: not an lm-eval task (nor a task YAML file); `lm_eval ls tasks` lists them, "
                "and kubetune ships flashcards, flashcards_mc"
            )
        try:
            get_task_dict([name], manager)
        except Exception as e:  # datasets' offline and network errors have no common type
            raise UserError(
                f"{spec.field} {name}: its data could not be fetched (lm-eval's tasks load it from the Hugging Face "
                f"Hub, which needs network): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None
    return manager


def scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """lm-eval's results as {task: {metric: value}} ('metric' for the unfiltered, else 'metric,filter')."""
    out: dict[str, dict[str, float]] = {}
    for task, entries in results["results"].items():
        for key, value in entries.items():
            if key in SKIPPED_KEYS or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, _, filtered = key.partition(",")
            out.setdefault(task, {})[metric if filtered in ("", "none") else key] = float(value)
    return out


def evaluate_tasks(target: str, tasks: str, limit: int | None = None, write: bool = True) -> dict[str, Any]:
    """Base and tuned model of the run at `target` on `tasks`; the table printed, summary.json updated."""
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit}: must be at least 1 (or leave it out for every example)")
    run = RunDir(Path(target))
    if not run.is_run():
        raise UserError(f"{target}: not a run directory; `kubetune eval RUN_DIR --tasks ...` evaluates a trained run")
    spec = parse_tasks(tasks)
    manager = task_manager(spec)
    table = run_tasks(run, spec.names, manager, limit)
    print_table(table, run)
    if write:
        record(run, table)
    return table


def run_tasks(run: RunDir, names: list[str], manager: Any, limit: int | None) -> dict[str, Any]:
    """{task: {metric: {base, tuned}}} of the run's base model and its tuned one."""
    from lm_eval import simple_evaluate

    from kubetune.data.templates import PromptRenderer

    base, tuned, tokenizer = run_models(run)
    recipe = run.recipe()
    chat = PromptRenderer(recipe.data.template, tokenizer, recipe.data.system_prompt).uses_chat_template
    options = {
        "tasks": names,
        "task_manager": manager,
        "limit": limit,
        "apply_chat_template": chat,  # the prompt the run was trained on
        "system_instruction": recipe.data.system_prompt if chat else None,
        "log_samples": False,
    }
    found = {}
    for which, lm in (("base", base), ("tuned", tuned)):
        log.info("lm-eval: %s on the %s model", ", ".join(names), which)
        found[which] = scores(simple_evaluate(model=lm, **options))
    table: dict[str, Any] = {}
    for task, metrics in found["tuned"].items():
        table[task] = {m: {"base": found["base"].get(task, {}).get(m), "tuned": v} for m, v in metrics.items()}
    return table


def run_models(run: RunDir) -> tuple[Any, Any, Any]:
    """(base LM, tuned LM, tokenizer): a LoRA run's base and adapter in one engine; a full run's
    base and trained weights in two."""
    from kubetune.engine.kvcache import register as register_slot_attention
    from kubetune.engine.lora import read_adapters
    from kubetune.models.runs import load_run
    from kubetune.training.lmeval import EngineLM, SharedEngine

    recipe = run.recipe()
    attn = register_slot_attention()
    if recipe.finetune.method == "full":
        trained, tokenizer = load_run(run, recipe, attn=attn)
        original, _ = load_run(recipe, attn=attn)
        return (
            EngineLM(shared=SharedEngine(original, tokenizer, [])),
            EngineLM(shared=SharedEngine(trained, tokenizer, [])),
            tokenizer,
        )
    model, tokenizer = load_run(run, recipe, attn=attn, with_adapter=False)
    adapters = read_adapters(model, [("tuned", str(run.finished_weights(recipe)))])
    base, tuned = EngineLM.pair(SharedEngine(model, tokenizer, adapters))
    return base, tuned, tokenizer


def print_table(table: dict[str, Any], run: RunDir) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Table(title=f"lm-eval: {run.path}")
    for column, justify in (("task", "left"), ("metric", "left"), ("base", "right"), ("tuned", "right")):
        out.add_column(column, justify=justify)  # type: ignore[arg-type]
    out.add_column("change", justify="right")
    for task, metrics in table.items():
        for metric, pair in metrics.items():
            base, tuned = pair["base"], pair["tuned"]
            change = "-" if base is None else f"{tuned - base:+.4f}"
            out.add_row(task, metric, _fmt(base), _fmt(tuned), change)
    Console(width=110).print(out)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def record(run: RunDir, table: dict[str, Any]) -> None:
    """`lm_eval` in summary.json (kept beside what training wrote; the tracker logs summary.json)."""
    path = run.summary_file
    summary = json.loads(path.read_text()) if path.is_file() else {}
    summary["lm_eval"] = {**summary.get("lm_eval", {}), **table}
    atomic_write_json(path, summary)
