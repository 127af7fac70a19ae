"""`kubetune monitor check`: is monitoring working, and if not, why. collect -> diagnose -> report.

- targets: every active scrape target Prometheus has, up or down (with its last error);
- monitors: each PodMonitor / ServiceMonitor (from the cluster, or a rendered directory) against
  the scrape jobs Prometheus actually runs. The Prometheus Operator names those jobs
  `podMonitor/<ns>/<name>/<i>`, so a monitor without one was never selected: most often it
  lacks the `release` label kube-prometheus-stack selects on, which is said with the fix;
  a monitor with a job but no targets selects no pod (labels, or port name);
- panels: every dashboard panel's queries; an empty one is explained by the first metric it
  names that has no series at all (its exporter is not scraped), or has none for `--job`.

`collect` talks to Prometheus; `diagnose` is pure (tests feed it snapshots), `report` draws
one rich table.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import yaml

from kubetune.contracts.findings import Finding
from kubetune.contracts.kube import KubeObject
from kubetune.contracts.metrics import RELEASE_LABEL
from kubetune.contracts.monitors import MONITOR_KINDS, OPERATOR_JOB_PREFIX, operator_job_prefix
from kubetune.monitor.exporters import source_of
from kubetune.monitor.expressions import Expression, panel_expressions
from kubetune.monitor.prometheus import Prometheus


@dataclass(frozen=True)
class PanelResult:
    expression: Expression
    has_data: bool
    why: str = ""  # when empty: the metric without series, and where it should come from


@dataclass
class Collected:
    prometheus: str
    targets: list[dict[str, Any]]
    scrape_jobs: list[str]
    release: str  # the `release` label value Prometheus selects on
    monitors: list[KubeObject] | None  # None: not readable (monitors_note says why)
    monitors_note: str = ""
    panels: list[PanelResult] = field(default_factory=list)
    job: str | None = None


# ---------------------------------------------------------------------------------- collect


def scrape_jobs(config_yaml: str) -> list[str]:
    config = yaml.safe_load(config_yaml) or {}
    return [job["job_name"] for job in config.get("scrape_configs") or []]


def _panel_result(prom: Prometheus, expression: Expression, job: str | None, cache: dict[str, str]) -> PanelResult:
    variables = {"job": job} if job else {}
    if prom.query(expression.expanded(variables)):
        return PanelResult(expression, True)
    for metric in expression.metrics:
        if metric not in cache:
            cache[metric] = _metric_gap(prom, metric, job)
        if cache[metric]:
            return PanelResult(expression, False, cache[metric])
    return PanelResult(expression, False, "its metrics have series, but none moved in the rate window")


def _metric_gap(prom: Prometheus, metric: str, job: str | None) -> str:
    """'' when `metric` has series (for `job`), else why a panel reading it is empty."""
    if not prom.has_series(metric):
        return f"metric {metric} has no series: is {source_of(metric) or 'its exporter'} scraped?"
    if job and metric.startswith("kubetune_train") and not prom.has_series(metric, f'job="{job}"'):
        return f"metric {metric} has no series for job {job}: is it running, with monitor.port set?"
    return ""


def collect(
    prom: Prometheus, release: str, monitors: list[KubeObject] | None, monitors_note: str = "", job: str | None = None
) -> Collected:
    cache: dict[str, str] = {}
    panels = [_panel_result(prom, e, job, cache) for e in panel_expressions()]
    jobs = scrape_jobs(prom.config())
    return Collected(prom.url, prom.targets(), jobs, release, monitors, monitors_note, panels, job)


# ---------------------------------------------------------------------------------- diagnose


# Scrape pools the dashboards read (kubetune's own, the exporters of exporters.py): shown one by
# one when up; any other pool that is all up is counted in one line, to keep one screen.
_RELEVANT = ("kubetune", "node-exporter", "kubelet", "cadvisor", "dcgm", "habana", "gaudi", "metric-exporter")


def _target_findings(c: Collected) -> list[Finding]:
    pools: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for target in c.targets:
        if c.job is None or target.get("labels", {}).get("job") == c.job or c.job in target.get("scrapePool", ""):
            pools[target.get("scrapePool", "?")].append(target)
    monitored = tuple(operator_job_prefix(m) for m in c.monitors or [] if m.get("kind") in MONITOR_KINDS)
    out, others = [], 0
    for pool, targets in sorted(pools.items()):
        down = [t for t in targets if t.get("health") != "up"]
        if down:
            error = down[0].get("lastError") or "not scraped yet"
            detail = f"{len(down)} of {len(targets)} down; {down[0].get('scrapeUrl')}: {error}"
            out.append(Finding("error", pool, detail, area="targets"))
        elif pool.startswith(monitored) or any(word in pool.lower() for word in _RELEVANT):
            out.append(Finding("ok", pool, f"{len(targets)} up", area="targets"))
        else:
            others += 1
    if others:
        out.append(Finding("ok", f"{others} other scrape pools", "all up", area="targets"))
    if not pools:
        what = f"for job {c.job}" if c.job else "at all"
        out.append(
            Finding("error", "-", f"Prometheus scrapes nothing {what}: are the monitors selected?", area="targets")
        )
    return out


def _monitor_finding(c: Collected, monitor: KubeObject) -> Finding:
    meta = monitor["metadata"]
    subject = f"{monitor['kind']} {meta.get('namespace')}/{meta['name']}"
    prefix = operator_job_prefix(monitor)
    jobs = [j for j in c.scrape_jobs if j.startswith(prefix)]
    if jobs:
        count = sum(1 for t in c.targets if t.get("scrapePool") in jobs)
        if count:
            return Finding("ok", subject, f"selected, {count} target(s)", area="monitors")
        return Finding("error", subject, _selects_nothing(monitor), area="monitors")
    return Finding("error", subject, _not_selected(c, monitor), area="monitors")


def _selects_nothing(monitor: KubeObject) -> str:
    spec = monitor["spec"]
    kind = "pod" if monitor["kind"] == "PodMonitor" else "Service"
    endpoints = spec.get("podMetricsEndpoints") or spec.get("endpoints") or [{}]
    port = endpoints[0].get("port", "(any)")
    labels = ",".join(f"{k}={v}" for k, v in spec["selector"].get("matchLabels", {}).items())
    names = spec.get("namespaceSelector", {}).get("matchNames") or [monitor["metadata"].get("namespace")]
    where = f"-n {names[0]}" if len(names) == 1 else "-A"
    return (
        f"selected by Prometheus but it finds no {kind}: none in namespace {', '.join(map(str, names))} has the "
        f"labels {labels} and a port named {port} (`kubectl get {kind.lower()}s {where} -l {labels}`)"
    )


def _not_selected(c: Collected, monitor: KubeObject) -> str:
    meta = monitor["metadata"]
    kind, name, namespace = monitor["kind"].lower(), meta["name"], meta.get("namespace", "default")
    fix = f"kubectl label {kind} {name} -n {namespace} {RELEASE_LABEL}={c.release} --overwrite"
    have = (meta.get("labels") or {}).get(RELEASE_LABEL)
    if have is None:
        return (
            f"ignored: it has no `{RELEASE_LABEL}` label and Prometheus selects only {RELEASE_LABEL}={c.release}. "
            f"Fix: `{fix}` (and render with monitor.release={c.release} / --release {c.release})"
        )
    if have != c.release:
        return f"ignored: it has {RELEASE_LABEL}={have}, Prometheus selects {RELEASE_LABEL}={c.release}. Fix: `{fix}`"
    return (
        f"not in Prometheus's configuration although labelled {RELEASE_LABEL}={c.release}: is the Prometheus "
        f"Operator running, and does the Prometheus' {monitor['kind'][0].lower()}{monitor['kind'][1:]}"
        f"NamespaceSelector include {namespace}?"
    )


def _monitor_findings(c: Collected) -> list[Finding]:
    if c.monitors is None:
        return [Finding("warning", "-", c.monitors_note, area="monitors")]
    monitors = [m for m in c.monitors if m.get("kind") in MONITOR_KINDS]
    if not monitors:
        return [Finding("warning", "-", "no PodMonitor or ServiceMonitor found", area="monitors")]
    if not any(job.startswith(tuple(f"{p}/" for p in OPERATOR_JOB_PREFIX.values())) for job in c.scrape_jobs):
        # every monitor would read "ignored", for a reason that is not theirs
        detail = (
            f"{c.prometheus} runs no scrape job made from a monitor: it is not managed by the Prometheus "
            "Operator, so PodMonitors and ServiceMonitors do nothing there; give --prometheus the URL of "
            "kube-prometheus-stack's Prometheus"
        )
        return [Finding("error", f"{len(monitors)} monitors", detail, area="monitors")]
    return [_monitor_finding(c, m) for m in monitors]


def _panel_findings(c: Collected) -> list[Finding]:
    """Empty panels grouped by reason (one exporter missing empties a whole row)."""
    by_reason: dict[str, list[str]] = defaultdict(list)
    for p in c.panels:
        if not p.has_data:
            title = p.expression.where.rsplit(" [", 1)[0]
            if title not in by_reason[p.why]:
                by_reason[p.why].append(title)
    full = len({p.expression.where.rsplit(" [", 1)[0] for p in c.panels if p.has_data})
    out = [Finding("ok", f"{full} panel{'s' * (full != 1)}", "have data", area="panels")] if full else []
    for why, titles in by_reason.items():
        shown = "; ".join(titles[:3]) + (f" (+{len(titles) - 3} more)" if len(titles) > 3 else "")
        out.append(Finding("warning", shown, f"no data: {why}", area="panels"))
    return out


def diagnose(c: Collected) -> list[Finding]:
    return _target_findings(c) + _monitor_findings(c) + _panel_findings(c)


# ---------------------------------------------------------------------------------- report

_STYLE = {"ok": "green", "info": "cyan", "warning": "yellow", "error": "bold red"}


def report(c: Collected, findings: list[Finding], width: int | None = None) -> str:
    """One table (area, status, what, detail), as text as wide as the terminal ($COLUMNS, else 160)."""
    import shutil

    from rich.console import Console
    from rich.table import Table

    width = width or max(100, shutil.get_terminal_size((160, 40)).columns)
    title = f"kubetune monitor check: {c.prometheus}" + (f", job {c.job}" if c.job else "")
    table = Table(title=title, show_lines=False, expand=True)
    for column, ratio in (("area", 1), ("status", 1), ("what", 4), ("detail", 8)):
        table.add_column(column, ratio=ratio, overflow="fold")
    for f in findings:
        table.add_row(f.area, f"[{_STYLE[f.severity]}]{f.severity}[/]", f.subject, f.problem)
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    with console.capture() as capture:
        console.print(table)
    return capture.get()
