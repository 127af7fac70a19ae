"""The progress line each node's first process prints where stdout is not a terminal (pods,
CI), its parser, and the Hugging Face Trainer's dict lines printed beside it.

What the engine prints (`training/runlog.py`) and what `kubetune k8s status` reads
(`k8s/progress.py`) both come from here, so the two cannot drift apart. Stdlib only: the
torch-free k8s layer imports it.

The line reads like the tqdm bar and the Trainer log a fine-tuning user watches in
`kubectl logs -f`: percent, bar, step/total, [elapsed<remaining, rate], then epoch, loss
and lr (and tokens, tok/s) as tqdm postfix fields:

    kubetune: train  72%|███████▏  | 2595/3597 [4:08:05<1:20:00, 2.08s/it, epoch=2.17, loss=2.2737,
    lr=5.54e-05, tokens=5312000, tok/s=850.2, rank=0]      (one line)

In a job of several processes the line ends with the printing process's global rank: every
node's local rank 0 prints it (each from its own copy of the global step, loss and tokens, which
every rank holds), because under an elastic c10d rendezvous `<job>-worker-0` is not necessarily
rank 0, and it is the pod users follow.

Beside it goes the line the Hugging Face Trainer (4.x) prints, which users and their scripts grep
or read with `ast.literal_eval`: the same keys and rounding (`trainer_log`, `trainer_train_end`,
`trainer_eval`), e.g. `{'loss': 2.2737, 'grad_norm': 0.4127, 'learning_rate': 5.54e-05, 'epoch': 2.17}`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

ACCURACY = "rewards/accuracies"  # a preference run's field: TRL's name for the pairs its rewards order right
PREFIX = "kubetune: train"  # a prefix of our own: other tqdm bars (datasets, shards) must not parse as training
BAR_WIDTH = 10
_BLOCKS = " ▏▎▍▌▋▊▉█"  # eighths, as tqdm draws them

_NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"
LINE = re.compile(
    rf"{PREFIX}\s+(?P<pct>\d+)%\|[^|]*\|\s*(?P<step>\d+)/(?P<total>\d+)\s*"
    rf"\[(?P<elapsed>[\d:]+)<(?P<remaining>[\d:]+|\?),\s*(?P<rate>{_NUMBER}|\?)(?P<unit>s/it|it/s)"
    r"(?P<fields>(?:,\s*[\w/]+=[^,\]]+)*)\]"
)


@dataclass(frozen=True)
class ProgressLine:
    step: int
    total: int
    elapsed_s: float
    remaining_s: float | None = None  # None before the first step of this process is timed
    s_per_it: float | None = None
    epoch: float | None = None
    loss: float | None = None
    lr: float | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    rank: int | None = None  # the printing process's global rank, in a job of several processes
    accuracy: float | None = None  # preference objectives: the step's rewards/accuracies


def format_interval(seconds: float | None) -> str:
    """tqdm's clock: `MM:SS`, or `H:MM:SS` from an hour on; `?` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(max(0.0, seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def parse_interval(text: str) -> float | None:
    """`4:08:05` or `01:20` -> seconds; None for `?`."""
    parts = text.split(":")
    if text == "?" or not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    seconds = 0
    for p in parts:
        seconds = seconds * 60 + int(p)
    return float(seconds)


def format_rate(s_per_it: float | None) -> str:
    """tqdm's rate: seconds per step when a step takes a second or more, else steps per second."""
    if s_per_it is None or not math.isfinite(s_per_it) or s_per_it <= 0:
        return "?it/s"
    return f"{s_per_it:.2f}s/it" if s_per_it >= 1 else f"{1 / s_per_it:.2f}it/s"


def bar(fraction: float, ascii_only: bool = False) -> str:
    fraction = min(1.0, max(0.0, fraction))
    if ascii_only:  # for a stdout that cannot encode the block characters
        return ("#" * round(fraction * BAR_WIDTH)).ljust(BAR_WIDTH)
    full, eighths = divmod(int(fraction * BAR_WIDTH * 8), 8)
    return ("█" * full + (_BLOCKS[eighths] if eighths else "")).ljust(BAR_WIDTH)


def format_line(p: ProgressLine, ascii_only: bool = False) -> str:
    fraction = p.step / p.total if p.total else 0.0
    fields = {
        "epoch": None if p.epoch is None else f"{p.epoch:.2f}",
        "loss": None if p.loss is None else f"{p.loss:.4f}",
        ACCURACY: None if p.accuracy is None else f"{p.accuracy:.4f}",
        "lr": None if p.lr is None else f"{p.lr:.2e}",
        "tokens": None if p.tokens is None else str(p.tokens),
        "tok/s": None if p.tokens_per_s is None else f"{p.tokens_per_s:.1f}",
        "rank": None if p.rank is None else str(p.rank),
    }
    postfix = "".join(f", {k}={v}" for k, v in fields.items() if v is not None)
    return (
        f"{PREFIX} {fraction * 100:3.0f}%|{bar(fraction, ascii_only)}| {p.step}/{p.total} "
        f"[{format_interval(p.elapsed_s)}<{format_interval(p.remaining_s)}, {format_rate(p.s_per_it)}{postfix}]"
    )


def parse_line(line: str) -> ProgressLine | None:
    """The progress in one log line (anything may precede it, e.g. a timestamp); None if it has none."""
    m = LINE.search(line)
    if m is None:
        return None
    fields = dict(f.strip().split("=", 1) for f in m["fields"].split(",") if "=" in f)
    rate = None if m["rate"] == "?" else float(m["rate"])
    s_per_it = rate if m["unit"] == "s/it" or rate is None else (1 / rate if rate else None)
    return ProgressLine(
        step=int(m["step"]),
        total=int(m["total"]),
        elapsed_s=parse_interval(m["elapsed"]) or 0.0,
        remaining_s=parse_interval(m["remaining"]),
        s_per_it=s_per_it,
        epoch=_number(fields.get("epoch")),
        loss=_number(fields.get("loss")),
        lr=_number(fields.get("lr")),
        tokens=int(fields["tokens"]) if fields.get("tokens", "").isdigit() else None,
        tokens_per_s=_number(fields.get("tok/s")),
        rank=int(fields["rank"]) if fields.get("rank", "").isdigit() else None,
        accuracy=_number(fields.get(ACCURACY)),
    )


def _number(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


# ------------------------------------------------------------------ the Hugging Face Trainer's lines


def trainer_log(loss: float, grad_norm: float, lr: float, epoch: float) -> dict[str, float]:
    """What the Trainer prints per logged step: loss to 4 places and epoch to 2, as its `log()` rounds them."""
    return {"loss": round(loss, 4), "grad_norm": grad_norm, "learning_rate": lr, "epoch": round(epoch, 2)}


def _speed(split: str, runtime_s: float, samples: int, steps: int) -> dict[str, float]:
    """transformers' `speed_metrics`: runtime to 4 places, the rates to 3 (none for a zero runtime)."""
    out = {f"{split}_runtime": round(runtime_s, 4)}
    if runtime_s > 0:
        out[f"{split}_samples_per_second"] = round(samples / runtime_s, 3)
        out[f"{split}_steps_per_second"] = round(steps / runtime_s, 3)
    return out


def trainer_train_end(runtime_s: float, samples: int, steps: int, train_loss: float, epoch: float) -> dict[str, float]:
    """The Trainer's last line of `train()` (its `total_flos` is never printed)."""
    return {**_speed("train", runtime_s, samples, steps), "train_loss": train_loss, "epoch": round(epoch, 2)}


def trainer_eval(loss: float, runtime_s: float, samples: int, steps: int, epoch: float) -> dict[str, float]:
    """The Trainer's line of an evaluation."""
    return {"eval_loss": loss, **_speed("eval", runtime_s, samples, steps), "epoch": round(epoch, 2)}
