"""The progress line, as rank 0 prints it in a pod and `kubetune k8s status` reads it back.

The engine side is the real `RunLog` / `Progress` (stdout captured, so not a terminal, as in
a pod); the reading side is `kubetune.k8s.progress.from_log`. Neither is tested against a
hand-written line here: what one prints, the other must read.
"""

from __future__ import annotations

import io
import re
import sys

import pytest

from kubetune import progress_line
from kubetune.k8s import progress
from kubetune.training.checkpoint import TrainState
from kubetune.training.metrics import RunLog
from kubetune.training.step import StepResult

# what a seed-002 user watches for in `kubectl logs -f`: tqdm's bar and the Trainer's numbers
TQDM_SHAPE = re.compile(r"\d+%\|.{10}\| \d+/\d+ \[\d\d:\d\d<(\d\d:\d\d|\?), \d+\.\d\d(s/it|it/s), ")


def _printed_steps(tmp_path, capsys, steps, total=40, start=0) -> list[str]:
    log = RunLog(tmp_path / "metrics.jsonl", total_steps=total, start_step=start, enabled=True)
    state = TrainState(step=start)
    for step, loss, lr, epoch in steps:
        state.step, state.tokens, state.train_time_s = step, 1000 * step, 0.5 * step
        log.step(state, StepResult(loss=loss, grad_norm=0.5, tokens=1000), lr, epoch, elapsed_s=0.5 * step)
    log.close()
    return capsys.readouterr().out.splitlines()


def test_what_runlog_prints_in_a_pod_is_what_status_reads(tmp_path, capsys):
    lines = _printed_steps(tmp_path, capsys, [(1, 2.5, 1e-4, 0.05), (29, 2.2737, 5.54e-05, 2.17)])
    assert len(lines) == 2 and all(TQDM_SHAPE.search(ln) for ln in lines), lines
    assert "epoch=2.17, loss=2.2737, lr=5.54e-05" in lines[1]  # the Trainer's numbers, as it rounds them
    # as `kubectl logs --timestamps` shows it, after other output
    p = progress.from_log(["loading model", "2025-01-01T00:00:00Z " + lines[1], "eval: running"])
    assert p is not None
    assert (p.step, p.total_steps, p.loss, p.lr, p.epoch, p.tokens) == (29, 40, 2.2737, 5.54e-05, 2.17, 29000)
    assert p.tokens_per_s == pytest.approx(2000.0)
    assert p.eta_s is not None and p.eta_s >= 0
    assert progress.describe(p).startswith("step 29/40 (72%)  epoch 2.17  loss 2.2737  lr 5.54e-05")
    assert " 72%|" in lines[1] and "| 29/40 [" in lines[1]


def test_after_a_resume_the_rate_counts_this_process_only(tmp_path, capsys):
    (line,) = _printed_steps(tmp_path, capsys, [(31, 1.0, 1e-5, 3.1)], total=40, start=30)
    parsed = progress_line.parse_line(line)
    assert parsed is not None and parsed.step == 31 and parsed.s_per_it is not None
    assert parsed.remaining_s == pytest.approx(parsed.s_per_it * 9, abs=1.0)  # 9 steps left at this rate


def test_a_diverged_loss_still_reads(tmp_path, capsys):
    (line,) = _printed_steps(tmp_path, capsys, [(3, float("nan"), 1e-4, 0.1)])
    p = progress.from_log([line])
    assert p is not None and p.step == 3 and p.loss != p.loss  # nan


def test_an_ascii_stdout_gets_an_ascii_bar(tmp_path, monkeypatch):
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", out)
    log = RunLog(tmp_path / "metrics.jsonl", total_steps=4, start_step=0, enabled=True)
    log.step(TrainState(step=2, tokens=10, train_time_s=1.0), StepResult(1.0, 0.5, 10), 1e-4, 0.5, 1.0)
    out.seek(0)
    line = out.read()
    assert "50%|#####     | 2/4" in line and progress.from_log([line]).step == 2


def test_the_line_of_earlier_versions_still_reads():
    old = "kubetune: step 12/100 loss 1.2345 lr 2.00e-04 tokens 12345 tok/s 850.2 eta 1m20s"
    p = progress.from_log([old])
    assert (p.step, p.total_steps, p.loss, p.eta_s, p.epoch) == (12, 100, 1.2345, 80.0, None)


def test_other_progress_bars_are_not_training():
    # datasets / checkpoint-shard bars share tqdm's shape; only kubetune's prefix counts
    assert progress.from_log([" 50%|█████     | 1/2 [00:01<00:01,  1.20s/it]"]) is None


@pytest.mark.parametrize(
    "seconds,text", [(0, "00:00"), (80, "01:20"), (3600, "1:00:00"), (4 * 3600 + 8 * 60 + 5, "4:08:05"), (None, "?")]
)
def test_tqdm_clock(seconds, text):
    assert progress_line.format_interval(seconds) == text
    assert progress_line.parse_interval(text) == seconds
