"""Progress from a pod's log lines and from metrics.jsonl.

The line itself is tested against what the real engine prints: tests/test_progress_line.py.
"""

from __future__ import annotations

import json

import pytest

from kubetune.k8s import progress

from .conftest import TOKEN

LINE = (
    "kubetune: train  12%|█▏        | 12/100 [00:10<01:20, 1.10s/it, loss=1.2345, lr=2.00e-04, tokens=12345, "
    "tok/s=850.2]"
)


def test_log_line_contract():
    p = progress.from_log(["noise", LINE])
    assert (p.step, p.total_steps, p.loss, p.lr, p.tokens, p.tokens_per_s, p.eta_s, p.source) == (
        12,
        100,
        1.2345,
        2e-4,
        12345,
        850.2,
        80.0,
        "rank-0 log",
    )


def test_the_last_line_wins_and_prefixes_are_fine():
    older = LINE.replace("| 12/", "| 11/")
    p = progress.from_log([older, "2025-01-01T00:00:00Z " + LINE, "eval: done"])
    assert p.step == 12


def test_no_progress_lines():
    assert progress.from_log(["starting", "kubetune: loading model"]) is None


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


# ---------------------------------------------------------------- both layouts, through the CLI and kmock

JOB, NS = "smollm2-135m-lora-cpu", "kubetune"


def _printed_by_the_engine(rank: int | None) -> str:
    """What a node's first process prints for two logged steps (the real RunLog, stdout not a terminal)."""
    import contextlib
    import io
    from pathlib import Path
    from tempfile import TemporaryDirectory

    from kubetune.training.checkpoint import TrainState
    from kubetune.training.runlog import RunLog
    from kubetune.training.step import StepResult

    out = io.StringIO()
    with TemporaryDirectory() as tmp, contextlib.redirect_stdout(out):
        log = RunLog(Path(tmp) / "metrics.jsonl", 40, 0, writes_metrics=rank in (None, 0), prints=True, rank=rank)
        for step in (11, 12):
            state = TrainState(step=step, tokens=1000 * step, train_time_s=2.0 * step)
            log.step(state, StepResult(loss=2.0 - step / 100, grad_norm=0.5, tokens=1000), 2e-4, step / 20, 2.0 * step)
        log.close()
    return "loading model\n" + out.getvalue()


def _pod(name: str, kind: str, index: int) -> dict:
    labels = {
        "app.kubernetes.io/instance": JOB,
        "app.kubernetes.io/component": "trainer",
        "training.kubeflow.org/replica-type": kind,
        "training.kubeflow.org/replica-index": str(index),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"containers": [{"name": "pytorch", "image": "img"}], "nodeName": "node-a"},
        "status": {"phase": "Running"},
    }


@pytest.mark.parametrize(
    "overrides,pods,global_rank",
    [
        # Master + Workers: the master is rank 0
        ([], [("master-0", "master", 0), ("worker-0", "worker", 0)], 0),
        # seed 002's Workers only: c10d gave worker-0 node rank 1 (global rank 1 here), and it prints too
        (["k8s.elastic.enabled=true"], [("worker-0", "worker", 0), ("worker-1", "worker", 1)], 1),
    ],
)
def test_status_and_logs_find_progress_in_both_layouts(cli, kube, tmp_path, overrides, pods, global_rank):
    token = tmp_path / "hf-token"
    token.write_text(TOKEN + "\n")
    submitted = cli("k8s", "submit", "smollm2-135m-lora-cpu", "--hf-token-file", str(token), *overrides)
    assert submitted.code == 0, submitted.err
    client = kube.client()
    for suffix, kind, index in pods:
        client.create(_pod(f"{JOB}-{suffix}", kind, index))
    followed = f"{JOB}-{pods[0][0]}"  # what the seed's `kubectl logs -f` follows
    kube.script_log(followed, _printed_by_the_engine(global_rank))
    result = cli("k8s", "status", JOB)
    assert result.code == 0, result.err
    (line,) = [ln for ln in result.out.splitlines() if ln.startswith("progress:")]
    assert line.startswith("progress: step 12/40 (30%)  epoch 0.60  loss 1.8800  lr 2.00e-04")
    assert line.endswith(f"(from rank-{global_rank} log)")
    logged = cli("k8s", "logs", JOB).out.splitlines()
    assert any(
        ln.startswith("{'loss': 1.88, 'grad_norm': 0.5, 'learning_rate': 0.0002, 'epoch': 0.6}") for ln in logged
    )
