"""Against a real Prometheus (Debian's 2.42) on loopback: every dashboard panel and every alert
signal returns data, the alert rules load and evaluate without errors, `kubetune monitor check`
reports up/down targets, an ignored monitor (no `release` label) with its fix, a monitor that
selects nothing, and the exporter behind an empty panel; the panels render to PNG.

The scrape jobs stand in for what the Prometheus Operator generates from kubetune's rendered
monitors (`kubetune monitor render`, `k8s render-components`): the same job names
(`podMonitor/<ns>/<name>/0`), the monitor's own relabelings and metric relabelings, static
targets instead of Kubernetes discovery. The exporters are the replay exporter of samples.py.
"""

from __future__ import annotations

import time

import pytest
import yaml

from kubetune.cluster.manifests import ComponentSettings, component_monitors
from kubetune.contracts.monitors import operator_job_prefix
from kubetune.monitor.dashboards import dashboards
from kubetune.monitor.expressions import all_expressions
from kubetune.monitor.rules import alerts, rule_file
from kubetune.monitor.snapshot import render_panels_png
from kubetune.netutil import free_port
from tests.kit.cli import run_cli_redirected

from .promtest import running_prometheus, scrape_job

pytestmark = pytest.mark.process

NS = "kubetune"
JOB = "demo"
RELEASE = "kube-prometheus-stack"
_CAMEL = {"sourceLabels": "source_labels", "targetLabel": "target_label"}


def operator_job(monitor: dict, url: str | None) -> dict:
    """The scrape job the Prometheus Operator makes of `monitor` (its first endpoint), scraping
    `url` statically (None: no target at all, as when the selector matches nothing)."""
    spec, namespace = monitor["spec"], monitor["metadata"]["namespace"]
    endpoint = (spec.get("podMetricsEndpoints") or spec["endpoints"])[0]
    job = scrape_job(
        operator_job_prefix(monitor) + "0", url or "http://unused/metrics", labels={"namespace": namespace}
    )
    if url is None:
        job["static_configs"] = []
    # the operator's default job label first, then the monitor's own relabelings
    default = {"target_label": "job", "replacement": f"{namespace}/{monitor['metadata']['name']}"}
    job["relabel_configs"] = [default] + [
        {_CAMEL.get(k, k): v for k, v in r.items()} for r in endpoint.get("relabelings", [])
    ]
    job["metric_relabel_configs"] = [
        {_CAMEL.get(k, k): v for k, v in r.items()} for r in endpoint.get("metricRelabelings", [])
    ]
    return job


def _without_release(monitor: dict, name: str) -> dict:
    meta = dict(
        monitor["metadata"],
        name=name,
        labels={k: v for k, v in monitor["metadata"]["labels"].items() if k != "release"},
    )
    return dict(monitor, metadata=meta)


def _renamed(monitor: dict, name: str) -> dict:
    return dict(monitor, metadata=dict(monitor["metadata"], name=name))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, replay_exporter):
    """Prometheus scraping the replay exporter through kubetune's monitors; the rendered objects
    (plus an unlabelled, an empty and a down monitor) in `objects`."""
    tmp = tmp_path_factory.mktemp("monitor")
    objects = tmp / "objects"
    result = run_cli_redirected(
        "monitor",
        "render",
        "-o",
        str(objects),
        "--recipe",
        "smollm2-135m-lora-cpu",
        f"k8s.name={JOB}",
        f"k8s.namespace={NS}",
    )
    assert result.code == 0, result.err
    rendered = [d for p in sorted(objects.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    pod_monitor = next(d for d in rendered if d["kind"] == "PodMonitor")
    service_monitor = next(d for d in rendered if d["kind"] == "ServiceMonitor")
    plugin, extender = component_monitors(ComponentSettings())
    unlabelled = _without_release(pod_monitor, "unlabelled-metrics")
    empty, down = _renamed(service_monitor, "empty-serve"), _renamed(pod_monitor, "down-metrics")
    for extra in (plugin, extender, unlabelled, empty, down):
        (objects / f"{extra['kind'].lower()}-{extra['metadata']['name']}.yaml").write_text(yaml.safe_dump(extra))
    url = replay_exporter.url
    jobs = [
        operator_job(pod_monitor, url("/training")),
        operator_job(service_monitor, url("/serving")),
        operator_job(plugin, url("/deviceplugin")),
        operator_job(extender, url("/extender")),
        operator_job(empty, None),
        operator_job(down, f"http://127.0.0.1:{free_port()}/metrics"),
        scrape_job("dcgm-exporter", url("/dcgm")),
        scrape_job("gaudi-metric-exporter", url("/gaudi")),
        scrape_job("node-exporter", url("/node")),
        scrape_job("kubelet", url("/cadvisor")),
    ]  # no job for `unlabelled`: Prometheus never selected it
    rules = tmp / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule_file(), sort_keys=False))
    with running_prometheus(tmp / "prometheus", jobs, (rules,)) as prom:
        prom.wait_for_scrapes(samples=4, down=(operator_job_prefix(down) + "0",))
        yield prom, objects


def test_every_panel_and_alert_signal_returns_finite_data(cluster):
    prom, _ = cluster
    assert len([e for e in all_expressions() if e.kind != "alert"]) > 60
    empty = prom.expressions_without_data()
    assert not empty, "\n".join(empty)


def test_training_series_carry_the_job_and_lose_the_processes_duplicates(cluster):
    prom, _ = cluster
    (series, *_) = prom.query('kubetune_train_step{rank="0"}')
    labels = series["metric"]
    assert labels["job"] == JOB and labels["namespace"] == NS and labels["node"] == "node-a"
    assert "exported_job" not in labels and "exported_node" not in labels  # the PodMonitor's metricRelabelings


def test_alert_rules_load_and_evaluate_without_errors(cluster):
    prom, _ = cluster
    deadline = time.monotonic() + 10
    while True:
        groups = prom.http.get("/api/v1/rules").json()["data"]["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"]}
        if all(r.get("lastEvaluation", "0001").startswith("20") for r in rules.values()):  # all evaluated once
            break
        assert time.monotonic() < deadline, rules
        time.sleep(0.5)
    assert set(rules) == {a.name for a in alerts()}
    assert {name: r["health"] for name, r in rules.items()} == dict.fromkeys(rules, "ok"), [
        r.get("lastError") for r in rules.values()
    ]
    firing = {r["name"] for r in rules.values() if r["state"] != "inactive"}
    assert not firing, "a healthy replay must not alert"


def test_check_names_the_unselected_monitor_and_its_fix(cluster, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per row: the cells read whole
    prom, objects = cluster
    result = run_cli_redirected("monitor", "check", "--prometheus", prom.url, "--objects", str(objects))
    assert result.code == 1, result.out + result.err  # a down target and ignored monitors are errors
    text = " ".join(result.out.split())  # the table wraps long cells
    assert "PodMonitor kubetune/unlabelled-metrics" in text
    assert "has no `release` label and Prometheus selects only release=kube-prometheus-stack" in text
    assert "kubectl label podmonitor unlabelled-metrics -n kubetune release=kube-prometheus-stack --overwrite" in text
    assert "ServiceMonitor kubetune/empty-serve" in text and "finds no Service" in text
    assert "1 of 1 down" in text and "connection refused" in text
    assert "PodMonitor kubetune/demo-metrics" in text and "selected, 1 target(s)" in text
    assert "ServiceMonitor kubetune-system/kubetune-scheduler-extender" in text
    assert "no data" not in text  # every panel has data here


def test_check_names_the_missing_exporter_and_job(cluster, start_prometheus, replay_exporter, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    _, objects = cluster
    prom = start_prometheus([scrape_job("training", replay_exporter.url("/training"), honor_labels=True)])
    prom.wait_for_scrapes(samples=3)
    result = run_cli_redirected(
        "monitor", "check", "--prometheus", prom.url, "--objects", str(objects), "--job", "nope"
    )
    text = " ".join(result.out.split())
    assert "metric DCGM_FI_DEV_GPU_UTIL has no series: is NVIDIA's DCGM exporter" in text
    assert "metric habanalabs_utilization has no series: is Intel's Gaudi metric exporter" in text
    assert "has no series for job nope" in text
    assert "Prometheus scrapes nothing for job nope" in text
    assert result.code == 1


def test_check_of_an_unreachable_prometheus_is_one_line():
    result = run_cli_redirected("monitor", "check", "--prometheus", f"http://127.0.0.1:{free_port()}", "--objects", ".")
    assert result.code == 2 and result.out == ""
    (line,) = result.err.strip().splitlines()
    assert line.startswith("kubetune: error: cannot reach Prometheus at http://127.0.0.1:") and "port-forward" in line


def test_every_dashboard_renders_to_png(cluster, tmp_path):
    prom, _ = cluster
    end = time.time()
    for dashboard in dashboards():
        path = render_panels_png(prom.url, dashboard, tmp_path, end - 30, end, step=1)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 50_000, path


def test_check_reads_the_clusters_monitors_and_prometheus_selector(cluster, monkeypatch):
    # the cluster through kubetune's own API boundary: its Prometheus selects release=prom
    from kubetune import kubeapi

    from ..k8s.fakes import FakeClient

    prom, objects = cluster
    monitors = [d for p in sorted(objects.glob("podmonitor-*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    other = _renamed(next(m for m in monitors if m["metadata"]["name"] == "demo-metrics"), "other-metrics")
    selector = {"podMonitorSelector": {"matchLabels": {"release": "prom"}}}
    prometheus = {"apiVersion": "monitoring.coreos.com/v1", "kind": "Prometheus", "spec": selector}
    prometheus["metadata"] = {"name": "k8s", "namespace": "monitoring"}
    monkeypatch.setattr(kubeapi, "connect", lambda: FakeClient([*monitors, other, prometheus]))
    monkeypatch.setenv("COLUMNS", "1000")
    result = run_cli_redirected("monitor", "check", "--prometheus", prom.url, "-n", NS)
    text = " ".join(result.out.split())
    assert "PodMonitor kubetune/other-metrics" in text
    assert "ignored: it has release=kube-prometheus-stack, Prometheus selects release=prom" in text
    assert "kubetune-system" not in text.split("monitors", 1)[1]  # -n kubetune: the components' monitors left out


def test_check_without_a_cluster_still_checks_targets_and_panels(cluster, monkeypatch, tmp_path):
    prom, _ = cluster
    (tmp_path / "kubeconfig").write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("COLUMNS", "1000")
    result = run_cli_redirected("monitor", "check", "--prometheus", prom.url)
    text = " ".join(result.out.split())
    assert "monitors not checked:" in text and "give --objects DIR" in text
    assert "panels │ have data" in text  # the Prometheus part is checked all the same
