"""The job's progress for `status.progress`: from the training metrics endpoint when the pod of
node rank 0 serves one (monitor.in_cluster: the container port named `metrics`), else from the
progress line in its log (`kubetune.k8s.follow.read_progress`). The page's lowest rank counts:
under an elastic c10d rendezvous that pod may hold ranks other than 0, and every rank holds the
same step, loss and epoch. Parsing is pure; `fetch_metrics` is the one HTTP call (to the pod's
IP: the operator runs in the cluster)."""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kubetune.contracts.metrics import METRICS_PATH, METRICS_PORT_NAME
from kubetune.k8s.progress import Progress

STEP = "kubetune_train_step"
TOTAL = "kubetune_train_total_steps"
ETA = "kubetune_train_eta_seconds"
LOSS = "kubetune_train_loss"
EVAL_LOSS = "kubetune_train_eval_loss"
TOKENS_PER_S = "kubetune_train_tokens_per_second"
EPOCH = "kubetune_train_epoch"
USED = (STEP, TOTAL, ETA, LOSS, EVAL_LOSS, TOKENS_PER_S, EPOCH)
FETCH_TIMEOUT_S = 3


def lowest_rank_values(text: str) -> tuple[int, dict[str, float]]:
    """(rank, its samples) of the lowest rank on the page (unlabelled samples count as rank 0),
    for the metrics the status uses."""
    by_rank: dict[int, dict[str, float]] = {}
    for sample in _samples(text):
        rank = sample.labels.get("rank", "0")
        if sample.name in USED and rank.isdigit():
            by_rank.setdefault(int(rank), {})[sample.name] = sample.value
    lowest = min(by_rank, default=0)
    return lowest, by_rank.get(lowest, {})


def _samples(text: str) -> list[Sample]:
    """The page's samples; those before the first line that is not Prometheus text when there is one
    (whatever answers on the port, the log stays the fallback)."""
    samples: list[Sample] = []
    try:
        for family in text_string_to_metric_families(text):
            samples += family.samples
    except ValueError:
        pass
    return samples


def from_metrics_text(text: str) -> tuple[Progress | None, float | None]:
    """(progress, eval loss) from a /metrics page; (None, None) before the first step is known."""
    rank, v = lowest_rank_values(text)
    if STEP not in v or not v.get(TOTAL):
        return None, None
    p = Progress(
        step=int(v[STEP]),
        total_steps=int(v[TOTAL]),
        loss=v.get(LOSS),
        tokens_per_s=v.get(TOKENS_PER_S),
        eta_s=v.get(ETA),
        epoch=v.get(EPOCH),
        source=f"rank-{rank} metrics",
    )
    return p, v.get(EVAL_LOSS)


def metrics_url(pod: dict[str, Any]) -> str | None:
    """http://POD_IP:PORT/metrics when the pod runs and a container exposes the metrics port."""
    ip = (pod.get("status") or {}).get("podIP")
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == METRICS_PORT_NAME and ip:
                return f"http://{ip}:{port['containerPort']}{METRICS_PATH}"
    return None


def fetch_metrics(url: str) -> str | None:
    """The page, or None when the pod does not answer (starting, gone): the log is the fallback."""
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
            body: bytes = response.read()
            return body.decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
