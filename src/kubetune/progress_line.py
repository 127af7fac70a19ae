"""The progress line rank 0 prints where stdout is not a terminal (pods, CI), and its parser.

What the engine prints (`training/metrics.py`) and what `kubetune k8s status` reads
(`k8s/progress.py`) both come from here, so the two cannot drift apart. Stdlib only: the
torch-free k8s layer imports it.

The line reads like the tqdm bar and the Trainer log a fine-tuning user watches in
`kubectl logs -f`: percent, bar, step/total, [elapsed<remaining, rate], then epoch, loss
and lr (and tokens, tok/s) as tqdm postfix fields:

    kubetune: train  72%|███████▏  | 2595/3597 [4:08:05<1:20:00, 2.08s/it, epoch=2.17, loss=2.2737,
    lr=5.54e-05, tokens=5312000, tok/s=850.2]      (one line)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

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
        "lr": None if p.lr is None else f"{p.lr:.2e}",
        "tokens": None if p.tokens is None else str(p.tokens),
        "tok/s": None if p.tokens_per_s is None else f"{p.tokens_per_s:.1f}",
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
    )


def _number(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None
