"""What a run tells: its log lines, summary.json and the before/after report."""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kubetune.fsutil import atomic_write_json
from kubetune.models.kernels import KernelPlan
from kubetune.rundir import RunDir
from kubetune.training.checkpoint import TrainState
from kubetune.training.dist import DistEnv
from kubetune.training.step import EvalResult

log = logging.getLogger("kubetune")

# the held-out accuracy each objective reports: the pairs' reward accuracy; GRPO's accuracy reward
EVAL_ACCURACY = {"grpo": "eval_accuracy"}
PAIRS_ACCURACY = "eval_rewards/accuracies"
PREFERENCE_KEYS = ("objective", "reward_accuracy_before", "reward_accuracy_after", "eval_after")
RL_KEYS = ("reward_before", "reward_after")
QUIET_LOGGERS = ("transformers", "datasets", "torch.distributed.checkpoint", "httpx")


def setup_logging(env: DistEnv) -> None:
    """kubetune's own lines at INFO from rank 0 (WARNING from the others), prefixed with the
    rank when there are several; libraries' loggers only for errors."""
    level = logging.INFO if env.is_main else logging.WARNING
    fmt = f"kubetune[{env.rank}]: %(message)s" if env.distributed else "kubetune: %(message)s"
    logging.basicConfig(level=level, format=fmt)
    for noisy in QUIET_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.ERROR)


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


@dataclass(frozen=True)
class Summary:
    """summary.json: the run's before/after numbers and sample answers."""

    model: str
    method: str
    steps: int
    eval_loss_before: float | None
    eval_loss_after: float | None
    perplexity_before: float | None
    perplexity_after: float | None
    eval_tokens: int
    train_tokens: int
    tokens_per_s: float
    train_time_s: float
    wall_s: float
    peak_rss_mb: float
    peak_rss_mb_per_rank: list[float]
    world_size: int
    precision: str = ""  # the compute precision the run used (auto resolved)
    kernels: str = ""  # the kernel choices and the measurements behind them
    samples: list[dict[str, Any]] = field(default_factory=list)
    # preference objectives (left out of summary.json under sft): the held-out pairs' reward
    # accuracy before and after, and TRL's eval metrics after; the perplexities above are then
    # those of the chosen (reference) answers, the losses the objective's
    objective: str = "sft"
    reward_accuracy_before: float | None = None
    reward_accuracy_after: float | None = None
    eval_after: dict[str, float] = field(default_factory=dict)
    # grpo: the held-out prompts' mean reward (greedy completions) before and after
    reward_before: float | None = None
    reward_after: float | None = None

    @classmethod
    def of(
        cls,
        model: str,
        method: str,
        state: TrainState,
        after: EvalResult,
        answers: list[dict[str, Any]],
        started_at: float,
        rss_per_rank: list[float],
        kernels: KernelPlan | None = None,
        objective: str = "sft",
    ) -> Summary:
        before = state.eval_before or {}
        accuracy = EVAL_ACCURACY.get(objective, PAIRS_ACCURACY)
        before_answers = {a["prompt"]: a["answer"] for a in before.get("answers", [])}
        return cls(
            model=model,
            method=method,
            steps=state.step,
            eval_loss_before=before.get("loss"),
            eval_loss_after=after.loss,
            perplexity_before=before.get("perplexity"),
            perplexity_after=after.perplexity,
            eval_tokens=after.tokens,
            train_tokens=state.tokens,
            tokens_per_s=round(state.tokens / max(state.train_time_s, 1e-9), 2),
            train_time_s=round(state.train_time_s, 2),
            wall_s=round(time.monotonic() - started_at, 2),
            peak_rss_mb=rss_per_rank[0],
            peak_rss_mb_per_rank=rss_per_rank,
            world_size=len(rss_per_rank),
            precision=kernels.precision if kernels else "",
            kernels=kernels.describe() if kernels else "",
            samples=[{**a, "answer_before": before_answers.get(a["prompt"])} for a in answers],
            objective=objective,
            reward_accuracy_before=before.get(accuracy),
            reward_accuracy_after=after.objective_metrics.get(accuracy),
            eval_after=after.objective_metrics,
            reward_before=before.get("eval_reward"),
            reward_after=after.objective_metrics.get("eval_reward"),
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        dropped = PREFERENCE_KEYS + RL_KEYS if self.objective == "sft" else () if self.objective == "grpo" else RL_KEYS
        for key in dropped:
            del out[key]
        return out

    def write(self, run_dir: RunDir) -> None:
        atomic_write_json(run_dir.summary_file, self.as_dict())


def print_report(summary: Summary, run_dir: RunDir) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=110)
    table = Table(title=f"kubetune: {summary.model} ({summary.method}), {summary.steps} steps")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    if summary.objective != "grpo":  # GRPO scores sampled completions, not the data's answers
        table.add_row("eval loss", fmt_number(summary.eval_loss_before), fmt_number(summary.eval_loss_after))
        table.add_row("perplexity", fmt_number(summary.perplexity_before), fmt_number(summary.perplexity_after))
    if summary.objective == "grpo":
        table.add_row("held-out reward", fmt_number(summary.reward_before), fmt_number(summary.reward_after))
        before, after = summary.reward_accuracy_before, summary.reward_accuracy_after
        table.add_row("held-out accuracy", fmt_number(before), fmt_number(after))
    elif summary.objective != "sft":
        before, after = summary.reward_accuracy_before, summary.reward_accuracy_after
        table.add_row("reward accuracy", fmt_number(before), fmt_number(after))
    console.print(table)
    console.print(
        f"trained on {summary.train_tokens:,} tokens at {summary.tokens_per_s:.0f} tokens/s; "
        f"wall {summary.wall_s:.0f} s; peak RSS {summary.peak_rss_mb:.0f} MB"
    )
    for s in summary.samples[:1]:
        console.print(f"\n[bold]question:[/bold] {_question(s['prompt'])}")
        if s.get("answer_before") is not None:
            console.print(f"[bold]before:[/bold]   {s['answer_before']}")
        console.print(f"[bold]after:[/bold]    {s['answer']}")
        console.print(f"[bold]reference:[/bold] {s['reference']}")
    console.print(
        f"\noutputs in {run_dir.path}/ (summary.json, metrics.jsonl, loss_curve.png, "
        f"{run_dir.weights(summary.method).name}/, checkpoints/)"
    )


def _question(prompt: str) -> str:
    """The user's turn of a chat-rendered prompt, else the prompt."""
    if "user\n" not in prompt:
        return prompt
    return prompt.split("user\n")[-1].split("<|im_end|>")[0].strip()


def fmt_number(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
