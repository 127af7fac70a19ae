"""`monitor check`'s diagnosis, pure: what Prometheus and the cluster report -> findings.
(tests/monitor/test_prometheus.py runs the same against a real Prometheus.)"""

from __future__ import annotations

from kubetune.contracts.monitors import endpoint, monitor_meta, pod_monitor
from kubetune.monitor.check import Collected, PanelResult, diagnose, report, scrape_jobs
from kubetune.monitor.expressions import Expression


def _monitor(name: str, release: str | None) -> dict:
    meta = monitor_meta(name, "ml", {"app": name}, release or "x")
    if release is None:
        del meta["labels"]["release"]
    return pod_monitor(meta, {"app": name}, [endpoint("metrics")])


def _target(pool: str, health: str = "up") -> dict:
    return {"scrapePool": pool, "health": health, "labels": {"job": pool}, "scrapeUrl": f"http://{pool}/metrics"}


def _collected(**kw) -> Collected:
    base = {"prometheus": "http://p", "targets": [], "scrape_jobs": [], "release": "prom", "monitors": []}
    return Collected(**{**base, **kw})


def test_monitors_prometheus_ignores_say_why():
    monitors = [_monitor("a", None), _monitor("b", "other"), _monitor("c", "prom"), _monitor("d", "prom")]
    c = _collected(monitors=monitors, scrape_jobs=["podMonitor/ml/d/0"], targets=[_target("podMonitor/ml/d/0")])
    by_subject = {f.subject: f for f in diagnose(c) if f.area == "monitors"}
    assert "has no `release` label" in by_subject["PodMonitor ml/a"].problem
    assert "kubectl label podmonitor a -n ml release=prom --overwrite" in by_subject["PodMonitor ml/a"].problem
    assert "it has release=other, Prometheus selects release=prom" in by_subject["PodMonitor ml/b"].problem
    assert "podMonitorNamespaceSelector include ml" in by_subject["PodMonitor ml/c"].problem
    assert by_subject["PodMonitor ml/d"].severity == "ok"
    assert {f.severity for s, f in by_subject.items() if s != "PodMonitor ml/d"} == {"error"}


def test_a_prometheus_without_the_operator_is_named_once():
    c = _collected(monitors=[_monitor("a", None), _monitor("b", "prom")], scrape_jobs=["prometheus", "node"])
    (finding,) = [f for f in diagnose(c) if f.area == "monitors"]
    assert finding.severity == "error" and "not managed by the Prometheus Operator" in finding.problem


def test_other_scrape_pools_that_are_up_take_one_line():
    targets = [_target("apiserver"), _target("coredns"), _target("node-exporter"), _target("etcd", "down")]
    findings = [f for f in diagnose(_collected(targets=targets)) if f.area == "targets"]
    assert [(f.subject, f.severity) for f in findings] == [
        ("etcd", "error"),
        ("node-exporter", "ok"),
        ("2 other scrape pools", "ok"),
    ]


def test_empty_panels_are_grouped_by_reason():
    def panel(title: str, ok: bool, why: str = "") -> PanelResult:
        return PanelResult(Expression("panel", f"D / R / {title} [A]", "x", ("x",)), ok, why)

    gaudi = "metric habanalabs_utilization has no series: is Intel's Gaudi metric exporter scraped?"
    panels = [panel("Loss", True), panel("Gaudi util", False, gaudi), panel("Gaudi power", False, gaudi)]
    findings = [f for f in diagnose(_collected(panels=panels, monitors=None, monitors_note="n")) if f.area != "targets"]
    assert [(f.area, f.severity, f.subject) for f in findings] == [
        ("monitors", "warning", "-"),
        ("panels", "ok", "1 panel"),
        ("panels", "warning", "D / R / Gaudi util; D / R / Gaudi power"),
    ]
    assert findings[-1].problem == f"no data: {gaudi}"


def test_report_is_one_table_and_scrape_jobs_come_from_the_config():
    c = _collected(targets=[_target("kubetune-x")])
    text = report(c, diagnose(c), width=120)
    assert "kubetune monitor check: http://p" in text and "kubetune-x" in text and "1 up" in text
    config = "global: {}\nscrape_configs:\n- job_name: podMonitor/a/b/0\n- job_name: x\n"
    assert scrape_jobs(config) == ["podMonitor/a/b/0", "x"]
