"""The progress line, as each node's first process prints it in a pod and `kubetune k8s status`
reads it back, and the Hugging Face Trainer's dict lines printed beside it.

The engine side is the real `RunLog` / `Progress` (stdout captured, so not a terminal, as in
a pod) or the real training loop; the reading side is `kubetune.k8s.progress.from_log` (and
`ast.literal_eval` for the dict lines, as users' scripts read them). Neither is tested against
a hand-written line here: what one prints, the other must read.
"""

from __future__ import annotations

import ast
import io
import json
import re
import sys

import pytest

from kubetune.contracts import progress_line
from kubetune.k8s import progress
from kubetune.training.checkpoint import TrainState
from kubetune.training.runlog import RunLog
from kubetune.training.step import StepResult

# what a seed-002 user watches for in `kubectl logs -f`: tqdm's bar and the Trainer's numbers
TQDM_SHAPE = re.compile(r"\d+%\|.{10}\| \d+/\d+ \[\d\d:\d\d<(\d\d:\d\d|\?), \d+\.\d\d(s/it|it/s), ")


def _printed_steps(tmp_path, capsys, steps, total=40, start=0) -> list[str]:
    """The progress lines of a one-process run (the Trainer's dict lines between them are left out)."""
    log = RunLog(tmp_path / "metrics.jsonl", total_steps=total, start_step=start, writes_metrics=True, prints=True)
    state = TrainState(step=start)
    for step, loss, lr, epoch in steps:
        state.step, state.tokens, state.train_time_s = step, 1000 * step, 0.5 * step
        log.step(state, StepResult(loss=loss, grad_norm=0.5, tokens=1000), lr, epoch, elapsed_s=0.5 * step)
    log.close()
    return [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("{")]


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
    log = RunLog(tmp_path / "metrics.jsonl", total_steps=4, start_step=0, writes_metrics=True, prints=True)
    log.step(TrainState(step=2, tokens=10, train_time_s=1.0), StepResult(1.0, 0.5, 10), 1e-4, 0.5, 1.0)
    out.seek(0)
    line = out.read()
    assert "50%|#####     | 2/4" in line and progress.from_log([line]).step == 2


def test_other_progress_bars_are_not_training():
    # datasets / checkpoint-shard bars share tqdm's shape; only kubetune's prefix counts
    assert progress.from_log([" 50%|█████     | 1/2 [00:01<00:01,  1.20s/it]"]) is None


@pytest.mark.parametrize(
    "seconds,text", [(0, "00:00"), (80, "01:20"), (3600, "1:00:00"), (4 * 3600 + 8 * 60 + 5, "4:08:05"), (None, "?")]
)
def test_tqdm_clock(seconds, text):
    assert progress_line.format_interval(seconds) == text
    assert progress_line.parse_interval(text) == seconds


def test_another_nodes_first_process_prints_its_rank_and_writes_no_metrics(tmp_path, capsys):
    # Under c10d, <job>-worker-0 may hold rank 2: its log still shows training, tagged with the rank.
    log = RunLog(tmp_path / "metrics.jsonl", total_steps=8, start_step=0, writes_metrics=False, prints=True, rank=2)
    log.step(TrainState(step=4, tokens=400, train_time_s=2.0), StepResult(1.5, 0.5, 100), 1e-4, 0.5, 2.0)
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].endswith(", rank=2]")
    p = progress.from_log(lines)
    assert (p.step, p.total_steps, p.loss, p.source) == (4, 8, 1.5, "rank-2 log")
    assert ast.literal_eval(lines[0]) == {"loss": 1.5, "grad_norm": 0.5, "learning_rate": 1e-4, "epoch": 0.5}
    assert not (tmp_path / "metrics.jsonl").exists()  # rank 0 alone writes the run's files


# the seed's users grep this, or read the line with ast.literal_eval
TRAINER_LOSS = re.compile(r"\{'loss': (?P<loss>[-\d.e]+), 'grad_norm': [-\d.e]+, 'learning_rate': (?P<lr>[-\d.e]+)")


def test_a_real_run_prints_the_trainers_lines_beside_the_progress_line(tmp_path, tiny_overrides, capsys):
    from kubetune.training.run import train_from_recipe

    out = tmp_path / "run"
    steps = ["train.max_steps=3", "train.log_every=1", "train.eval_every=2", "eval.generate=0"]
    summary = train_from_recipe(None, [*tiny_overrides, *steps, f"output_dir={out}"])
    lines = capsys.readouterr().out.splitlines()
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    dicts = [ast.literal_eval(ln) for ln in lines if ln.startswith("{'")]
    logged = [d for d in dicts if "loss" in d]
    bars = [progress_line.parse_line(ln) for ln in lines if ln.startswith(progress_line.PREFIX)]
    assert [list(d) for d in logged] == [["loss", "grad_norm", "learning_rate", "epoch"]] * 3
    for d, rec, bar in zip(logged, records, bars, strict=True):
        assert d["loss"] == round(rec["loss"], 4) == bar.loss  # rounded as the Trainer rounds it
        assert (d["grad_norm"], d["learning_rate"]) == (rec["grad_norm"], rec["lr"])
        assert d["epoch"] == round(rec["epoch"], 2) == bar.epoch
    first = next(ln for ln in lines if ln.startswith("{'loss'"))
    assert float(TRAINER_LOSS.search(first)["loss"]) == logged[0]["loss"]

    evals = [d for d in dicts if "eval_loss" in d]  # before, at step 2, after
    assert [list(d) for d in evals] == [
        ["eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch"]
    ] * 3
    (during,) = [loss for _, loss in _eval_history(out)]
    assert [d["eval_loss"] for d in evals] == [summary.eval_loss_before, during, summary.eval_loss_after]
    (end,) = [d for d in dicts if "train_runtime" in d]
    assert list(end) == ["train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "epoch"]
    assert end["train_loss"] == pytest.approx(sum(r["loss"] for r in records) / 3)
    # from the unrounded runtime, as the Trainer does: within one unit of the last place
    # (the runtime shown is rounded to 4 places: on a fast run that moves 3 / runtime by more than
    # the last place of steps/s, so the bound follows the runtime)
    runtime = end["train_runtime"]
    bound = 3 * 5e-5 / (runtime - 5e-5) ** 2 + 5e-4 + 1e-9
    assert end["train_steps_per_second"] == pytest.approx(3 / runtime, abs=bound)
    assert end["epoch"] == logged[-1]["epoch"]


def _eval_history(out) -> list[list[float]]:
    """The evaluations during training, as the last checkpoint recorded them."""
    return json.loads((out / "checkpoints" / "step-3" / "meta.json").read_text())["eval_history"]


def test_the_readmes_example_lines_read_back():
    from pathlib import Path

    guide = (Path(__file__).parents[1] / "docs" / "cluster.md").read_text()
    block = guide.split("## 4. Watch")[1].split("```text\n")[1].split("```")[0].splitlines()
    trainer, bar = ast.literal_eval(block[0]), progress_line.parse_line(block[1])
    assert bar is not None and (bar.loss, bar.lr, bar.epoch, bar.rank) == (2.2737, 5.54e-05, 2.17, 0)
    assert (trainer["loss"], trainer["learning_rate"], trainer["epoch"]) == (bar.loss, bar.lr, bar.epoch)
    assert list(trainer) == list(progress_line.trainer_log(1.0, 1.0, 1.0, 1.0))
