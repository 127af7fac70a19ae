"""Progress from the log line of earlier engines (jobs still running) and metrics.jsonl.

The current line is tested against what the real engine prints: tests/test_progress_line.py.
"""

from __future__ import annotations

import json

import pytest

from kubetune.k8s import progress

LINE = "kubetune: step 12/100 loss 1.2345 lr 2.00e-04 tokens 12345 tok/s 850.2 eta 1m20s"


def test_log_line_contract():
    p = progress.from_log(["noise", LINE])
    assert (p.step, p.total_steps, p.loss, p.lr, p.tokens, p.tokens_per_s, p.eta_s) == (
        12,
        100,
        1.2345,
        2e-4,
        12345,
        850.2,
        80.0,
    )


def test_the_last_line_wins_and_prefixes_are_fine():
    older = LINE.replace("step 12/", "step 11/")
    p = progress.from_log([older, "2025-01-01T00:00:00Z " + LINE, "eval: done"])
    assert p.step == 12


def test_no_progress_lines():
    assert progress.from_log(["starting", "kubetune: loading model"]) is None


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("1m20s", 80),
        ("45s", 45),
        ("2h", 7200),
        ("1d2h3m4s", 93784),
        ("1h05m", 3900),
        ("2m03s", 123),  # earlier engines' eta forms
        ("?", None),
        ("1m20", None),
        ("", None),
    ],
)
def test_parse_eta(text, seconds):
    assert progress.parse_eta(text) == seconds


@pytest.mark.parametrize("seconds,text", [(80, "1m20s"), (0, "0s"), (3600, "1h"), (93784, "1d2h3m4s"), (None, "?")])
def test_format_eta(seconds, text):
    assert progress.format_eta(seconds) == text


def test_metrics_jsonl():
    rows = [
        {
            "step": s,
            "total_steps": 50,
            "epoch": 0.1 * s,
            "loss": 1.0,
            "lr": 1e-4,
            "grad_norm": 0.5,
            "tokens": 100 * s,
            "tokens_per_s": 20.0,
            "elapsed_s": 3.0 * s,
        }
        for s in (1, 5)
    ]
    p = progress.from_metrics("\n".join(json.dumps(r) for r in rows) + "\n")
    assert (p.step, p.eta_s, p.source) == (5, 135.0, "metrics.jsonl")
    assert progress.from_metrics("") is None
    assert progress.from_metrics("not json\n") is None


def test_describe_done():
    p = progress.Progress(step=100, total_steps=100, loss=0.5, source="rank-0 log")
    assert progress.describe(p) == "step 100/100 (100%)  loss 0.5000  eta done  (from rank-0 log)"
