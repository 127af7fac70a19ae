"""Training progress from what the engine writes (pure parsing, no cluster).

Each node's first process prints, when not on a terminal, the line of `kubetune.contracts.progress_line`
(the module the engine prints it with, so the two agree by construction), ending with its global
rank in a job of several processes; any training pod's log therefore holds it, whichever node
rank an elastic rendezvous gave that pod:

    kubetune: train  12%|█▏        | 12/100 [00:10<01:20, 1.10s/it, epoch=0.12, loss=1.2345, lr=2.00e-04, ..., rank=4]

It also appends one JSON object per logged step to `output_dir/metrics.jsonl` with keys step,
total_steps, epoch, loss, lr, grad_norm, tokens, tokens_per_s, elapsed_s. At the end it
writes `output_dir/summary.json`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass

from kubetune.contracts.progress_line import ProgressLine, parse_line


@dataclass(frozen=True)
class Progress:
    step: int
    total_steps: int
    loss: float | None = None
    lr: float | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    epoch: float | None = None
    source: str = ""

    @property
    def fraction(self) -> float:
        return self.step / self.total_steps if self.total_steps else 0.0


def format_eta(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "?"
    seconds = round(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    out = "".join(f"{v}{u}" for v, u in ((days, "d"), (hours, "h"), (minutes, "m")) if v)
    return out + f"{secs}s" if secs or not out else out


def from_log(lines: Iterable[str]) -> Progress | None:
    """The last progress line among `lines` (an iterable of log lines)."""
    last = None
    for line in lines:
        found = parse_line(line)
        if found is not None:
            last = found
    return None if last is None else _from_progress_line(last)


def _from_progress_line(p: ProgressLine) -> Progress:
    return Progress(
        step=p.step,
        total_steps=p.total,
        loss=p.loss,
        lr=p.lr,
        tokens=p.tokens,
        tokens_per_s=p.tokens_per_s,
        eta_s=p.remaining_s,
        epoch=p.epoch,
        source=f"rank-{p.rank or 0} log",
    )


def from_metrics(text: str) -> Progress | None:
    """The last complete record of a metrics.jsonl text (a half-written last line is skipped)."""
    for line in reversed(text.strip().splitlines()):
        try:
            rec = json.loads(line)
            step, total = int(rec["step"]), int(rec["total_steps"])
        except (ValueError, KeyError, TypeError):
            continue
        elapsed = rec.get("elapsed_s")
        eta = elapsed / step * (total - step) if elapsed and step else None
        return Progress(
            step=step,
            total_steps=total,
            loss=rec.get("loss"),
            lr=rec.get("lr"),
            tokens=rec.get("tokens"),
            tokens_per_s=rec.get("tokens_per_s"),
            eta_s=eta,
            epoch=rec.get("epoch"),
            source="metrics.jsonl",
        )
    return None


def describe(p: Progress) -> str:
    parts = [f"step {p.step}/{p.total_steps} ({p.fraction:.0%})"]
    if p.epoch is not None:
        parts.append(f"epoch {p.epoch:.2f}")
    if p.loss is not None:
        parts.append(f"loss {p.loss:.4f}")
    if p.lr is not None:
        parts.append(f"lr {p.lr:.2e}")
    if p.tokens_per_s is not None:
        parts.append(f"tok/s {p.tokens_per_s:.1f}")
    parts.append(f"eta {format_eta(p.eta_s) if p.step < p.total_steps else 'done'}")
    return "  ".join(parts) + f"  (from {p.source})"
