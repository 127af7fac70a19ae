"""What a run reports: metrics.jsonl, a progress bar or plain log lines, the loss curve.

Rank 0 writes metrics.jsonl and the loss curve (one copy on the shared volume). Every node's
first process (local rank 0) prints the progress line and the Hugging Face Trainer's dict lines
(`kubetune.contracts.progress_line`), so that the log of any pod shows training, whichever node rank an
elastic rendezvous gave it. metrics.jsonl is append-only, one JSON object per logged step;
after a resume, lines beyond the resumed step (logged by the killed run after its last
checkpoint) are dropped so the file describes one consistent trajectory.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubetune.contracts.progress_line import (
    ACCURACY,
    ProgressLine,
    format_line,
    trainer_eval,
    trainer_log,
    trainer_train_end,
)
from kubetune.fsutil import atomic_write_text

if TYPE_CHECKING:
    from kubetune.training.checkpoint import TrainState
    from kubetune.training.step import StepResult


class MetricsLog:
    def __init__(self, path: Path, resume_step: int):
        self.path = Path(path)
        if self.path.exists():
            kept = [
                ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= resume_step
            ]
            atomic_write_text(self.path, "".join(ln + "\n" for ln in kept))
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held open for the whole run, closed by close())

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class Progress:
    """A rich progress bar on a terminal; elsewhere (pods, CI) the line of
    `kubetune.contracts.progress_line`, which `kubetune k8s status` reads back."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool, rank: int | None = None):
        self.enabled = enabled
        self.total = total_steps
        self.start_step = start_step
        self.rank = rank  # tags the line in a job of several processes
        self.t0 = time.monotonic()
        self._bar = None
        self._ascii_only = not _can_print("█▏")
        if enabled and sys.stdout.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeRemainingColumn,
            )
            from rich.progress import (
                Progress as RichProgress,
            )

            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:.0f} tok/s"),
                TimeRemainingColumn(),
            )
            self._task = self._bar.add_task(
                "train", total=total_steps, completed=start_step, loss=float("nan"), tps=0.0
            )
            self._bar.start()

    def update(
        self, step: int, loss: float, lr: float, tokens: int, tps: float, epoch: float, pairs: dict[str, float]
    ) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=loss, tps=tps)
            return
        line = dataclasses.replace(self.line(step, loss, lr, tokens, tps, epoch), accuracy=pairs.get(ACCURACY))
        print(format_line(line, self._ascii_only), flush=True)

    def trainer_line(self, values: dict[str, float]) -> None:
        """A Trainer-style dict line (above the bar on a terminal: rich redirects stdout)."""
        if self.enabled:
            print(values, flush=True)

    def line(self, step: int, loss: float, lr: float, tokens: int, tps: float, epoch: float) -> ProgressLine:
        """Rate and remaining time over the steps of this process (as tqdm counts after a resume)."""
        elapsed = time.monotonic() - self.t0
        done = step - self.start_step
        s_per_it = elapsed / done if done > 0 else None
        remaining = s_per_it * (self.total - step) if s_per_it is not None else None
        return ProgressLine(step, self.total, elapsed, remaining, s_per_it, epoch, loss, lr, tokens, tps, self.rank)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _can_print(text: str) -> bool:
    """Whether stdout's encoding holds `text` (a pod's may be ASCII: the bar then uses `#`)."""
    try:
        text.encode(getattr(sys.stdout, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def plot_loss_curve(metrics_path: Path, out_png: Path, eval_points: list[list[float | None]]) -> None:
    """loss_curve.png: the loss (train and eval), tokens/s over time and the step-time split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(ln) for ln in Path(metrics_path).read_text().splitlines() if ln.strip()]
    fig, (loss_ax, speed_ax, split_ax) = plt.subplots(3, 1, figsize=(7, 9), dpi=100, sharex=True)
    _plot_loss(loss_ax, records, eval_points)
    _plot_speed(speed_ax, records)
    _plot_step_split(split_ax, records)
    split_ax.set_xlabel("optimizer step")
    fig.tight_layout()
    tmp = out_png.with_name(f".{out_png.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out_png)


def _plot_loss(ax: Any, records: list[dict], eval_points: list[list[float | None]]) -> None:
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss")
    scored = [(s, v) for s, v in eval_points if s is not None and v is not None]
    if scored:
        ax.plot([s for s, _ in scored], [v for _, v in scored], "o--", label="eval loss")
    preference = [r for r in records if ACCURACY in r]
    ax.set_ylabel("loss (nats / target token)" if not preference else "loss (the objective's)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    if preference:  # TRL's reward accuracy beside the loss, on its own 0-1 scale
        acc = ax.twinx()
        acc.plot([r["step"] for r in preference], [r[ACCURACY] for r in preference], color="tab:red", label=ACCURACY)
        acc.set_ylim(0, 1.05)
        acc.set_ylabel(ACCURACY)
        acc.legend(loc="upper right")


def _plot_speed(ax: Any, records: list[dict]) -> None:
    ax.plot([r["step"] for r in records], [r["tokens_per_s"] for r in records], color="tab:green")
    ax.set_ylabel("tokens/s (run average)")
    ax.grid(alpha=0.3)


def _plot_step_split(ax: Any, records: list[dict]) -> None:
    """Seconds per step by phase, stacked (runs logged before kubetune recorded it have none)."""
    timed = [r for r in records if r.get("step_s")]
    phases = list(timed[0]["step_s"]) if timed else []
    if phases:
        ax.stackplot(
            [r["step"] for r in timed], *[[r["step_s"].get(p, 0.0) for r in timed] for p in phases], labels=phases
        )
        ax.legend(loc="upper right", fontsize="small")
    ax.set_ylabel("seconds per step")
    ax.grid(alpha=0.3)


class RunLog:
    """The record of the fit: rank 0's metrics.jsonl line per logged step, and on each node's
    first process the progress line and the Trainer's dict line beside it."""

    def __init__(
        self,
        metrics_path: Path,
        total_steps: int,
        start_step: int,
        writes_metrics: bool,
        prints: bool,
        rank: int | None = None,
        rows_per_step: int = 0,
        on_row: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.total_steps = total_steps
        self.on_row = on_row  # the experiment trackers: each metrics.jsonl row as it is written
        self.metrics = MetricsLog(metrics_path, start_step) if writes_metrics else None
        self.progress = Progress(total_steps, start_step, enabled=prints, rank=rank)
        self.rows_per_step = rows_per_step
        self._losses: list[float] = []  # every step's of this process, for the Trainer's train_loss

    def trained(self, loss: float) -> None:
        """Every step's loss (logged or not): the Trainer's final train_loss is their mean."""
        self._losses.append(loss)

    def step(self, state: TrainState, result: StepResult, lr: float, epoch: float, elapsed_s: float) -> None:
        tps = state.tokens / max(state.train_time_s, 1e-9)
        trainer = trainer_log(result.loss, result.grad_norm, lr, epoch)
        self.progress.trainer_line({**trainer, **rounded(result.objective_metrics)})
        self.progress.update(state.step, result.loss, lr, state.tokens, tps, epoch, result.objective_metrics)
        if self.metrics is None:
            return
        row = {
            "step": state.step,
            "total_steps": self.total_steps,
            "epoch": round(epoch, 4),
            "loss": result.loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "tokens": state.tokens,
            "tokens_per_s": round(tps, 2),
            "elapsed_s": round(elapsed_s, 2),
            "step_s": {phase: round(seconds, 5) for phase, seconds in result.phases.items()},
            **{k: v for k, v in result.objective_metrics.items() if k != "loss"},  # TRL's names
        }
        self.metrics.write(row)
        if self.on_row is not None:
            self.on_row(row)

    def trained_to_the_end(self, epoch: float) -> None:
        """The Trainer's closing line, over this process's steps (as it counts after a resume)."""
        steps = len(self._losses)
        runtime = time.monotonic() - self.progress.t0
        train_loss = sum(self._losses) / max(steps, 1)
        self.progress.trainer_line(trainer_train_end(runtime, steps * self.rows_per_step, steps, train_loss, epoch))

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


def print_eval_line(
    shows: bool,
    loss: float | None,
    runtime_s: float,
    samples: int,
    steps: int,
    epoch: float,
    pairs: dict[str, float] | None = None,
) -> None:
    """The Trainer's line of an evaluation (with TRL's `eval_rewards/...` of a preference run), on
    each node's first process; nothing when nothing was scored."""
    if shows and loss is not None:
        print({**trainer_eval(loss, runtime_s, samples, steps, epoch), **(pairs or {})}, flush=True)


def rounded(pairs: dict[str, float]) -> dict[str, float]:
    """TRL's metrics as its log line rounds them (the loss is the Trainer line's own)."""
    return {k: round(v, 4) for k, v in pairs.items() if k != "loss"}
