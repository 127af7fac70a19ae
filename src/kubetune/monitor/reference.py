"""The monitoring tables of docs/monitoring.md, generated from the code that defines them (a test
holds the page equal): the training metrics of the contract, the alerts, the dashboards."""

from __future__ import annotations

from kubetune.contracts.metrics import TRAIN_LABELS, TRAIN_METRICS, exposed_names
from kubetune.monitor.dashboards import dashboards
from kubetune.monitor.rules import alerts


def training_metrics_markdown() -> str:
    extra = ", ".join(f"`{label}`" for label in TRAIN_LABELS)
    rows = [f"| metric (labels {extra} and) | type | meaning |", "|---|---|---|"]
    for m in TRAIN_METRICS:
        name = exposed_names(m)[0].removesuffix("_bucket") if m.kind == "histogram" else exposed_names(m)[0]
        labels = [label for label in m.labels if label not in TRAIN_LABELS]
        shown = f"`{name}{{{','.join(labels)}}}`" if labels else f"`{name}`"
        rows.append(f"| {shown} | {m.kind} | {m.help} |")
    return "\n".join(rows)


def alerts_markdown() -> str:
    rows = ["| alert | severity | fires when |", "|---|---|---|"]
    rows += [f"| `{a.name}` | {a.severity} | {a.when} |" for a in alerts()]
    return "\n".join(rows)


def dashboards_markdown() -> str:
    rows = ["| dashboard (uid) | rows |", "|---|---|"]
    rows += [f"| {d.title} (`{d.uid}`) | {'; '.join(r.title for r in d.rows)} |" for d in dashboards()]
    return "\n".join(rows)
