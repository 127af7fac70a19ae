"""The monitors select what they must: the job's PodMonitor its pods and their `metrics` port
(which the pods serve, because the recipe they read has monitor.port set), the server's
ServiceMonitor its Service's `http` port; the `release` label follows monitor.release; all of it
validates strictly; submit copes with a cluster without the Prometheus Operator; `kubetune
monitor render` writes the rules, dashboards and monitors."""

from __future__ import annotations

import yaml

from kubetune.contracts.metrics import DEFAULT_TRAIN_PORT
from kubetune.k8s import follow
from kubetune.k8s.render import render
from kubetune.k8s.serve import ServeSettings
from kubetune.k8s.serve.render import render_serve
from kubetune.k8s.validate import validate_objects
from kubetune.kubeapi import NotFound
from kubetune.recipe.loader import load_recipe
from tests.kit.cli import run_cli_redirected

from ..k8s.fakes import FakeClient

SMOL = "smollm2-135m-lora-cpu"


def _job(*overrides: str) -> list[dict]:
    return render(load_recipe(SMOL, ["k8s.name=demo", *overrides]).recipe, with_runtime=True).objects


def _one(objects: list[dict], kind: str) -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj


def _pod_template(objects: list[dict]) -> dict:
    return _one(objects, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]


def test_the_pod_monitor_selects_the_jobs_pods_on_the_port_they_serve():
    objects = _job()
    monitor, template = _one(objects, "PodMonitor"), _pod_template(objects)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [template["metadata"].get("namespace", "kubetune")]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
    assert ports[endpoint["port"]] == DEFAULT_TRAIN_PORT
    served = yaml.safe_load(_one(objects, "ConfigMap")["data"]["recipe.yaml"])["monitor"]
    assert served["port"] == DEFAULT_TRAIN_PORT  # what `kubetune train` in the pod listens on
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["job"]["replacement"] == "demo"
    assert relabel["node"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert objects[-1]["kind"] == "PyTorchJob"  # the job stays last (submit and status read it there)


def test_a_trainjob_is_scraped_at_the_pod_ip_and_metrics_port():
    objects = _job("k8s.api=trainjob", "monitor.port=9555")
    (endpoint,) = _one(objects, "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert "port" not in endpoint  # a runtime patch cannot declare one
    address = next(r for r in endpoint["relabelings"] if r.get("targetLabel") == "__address__")
    assert address["sourceLabels"] == ["__meta_kubernetes_pod_ip"] and address["replacement"] == "$1:9555"
    keep = endpoint["relabelings"][0]
    assert keep["action"] == "keep" and keep["regex"] == "node"  # the Trainer's container, not sidecars
    assert yaml.safe_load(_one(objects, "ConfigMap")["data"]["recipe.yaml"])["monitor"]["port"] == 9555


def test_release_label_and_opting_out():
    assert _one(_job("monitor.release=prom"), "PodMonitor")["metadata"]["labels"]["release"] == "prom"
    off = _job("monitor.in_cluster=false")
    assert not [o for o in off if o["kind"] == "PodMonitor"]
    assert [p["name"] for p in _pod_template(off)["spec"]["containers"][0]["ports"]] == ["pytorchjob-port"]


def test_the_service_monitor_selects_the_servers_service():
    recipe = load_recipe(SMOL, ["k8s.name=demo", "monitor.release=prom"]).recipe
    objects = render_serve(recipe, ServeSettings()).objects
    monitor, service = _one(objects, "ServiceMonitor"), _one(objects, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in [p["name"] for p in service["spec"]["ports"]]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "prom"


def test_monitors_validate_strictly_and_the_check_can_fail():
    objects = _job() + render_serve(load_recipe(SMOL, ["k8s.name=demo"]).recipe, ServeSettings()).objects
    assert validate_objects(objects) == []
    monitor = _one(objects, "PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["prot"] = "metrics"
    (problem,) = validate_objects([monitor])
    assert "podMetricsEndpoints/0/prot: unknown field" in problem


class _NoPrometheusOperator(FakeClient):
    """A cluster without the monitoring.coreos.com CRDs: creating a PodMonitor is a 404."""

    def create(self, obj):
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            raise NotFound(f"create {obj['kind']} {obj['metadata']['name']}: not found")
        return super().create(obj)


def test_submit_without_the_prometheus_operator_skips_the_monitor_only():
    rendered = render(load_recipe(SMOL, ["k8s.name=demo"]).recipe)
    lines = follow.submit(_NoPrometheusOperator(), rendered)
    (skipped,) = [line for line in lines if line.startswith("skipped")]
    assert skipped.startswith("skipped PodMonitor") and "monitor.in_cluster=false" in skipped
    assert any(line.startswith("created PyTorchJob") for line in lines)


def test_delete_removes_the_jobs_pod_monitor():
    client = FakeClient()
    follow.submit(client, render(load_recipe(SMOL, ["k8s.name=demo"]).recipe))
    assert client.get("monitoring.coreos.com/v1", "PodMonitor", "demo-metrics", "kubetune") is not None
    lines = follow.delete(client, "demo", "kubetune")
    assert "deleted PodMonitor kubetune/demo-metrics" in lines
    assert client.get("monitoring.coreos.com/v1", "PodMonitor", "demo-metrics", "kubetune") is None


def test_monitor_render_writes_rules_dashboards_and_monitors(tmp_path):
    out = tmp_path / "monitoring"
    result = run_cli_redirected(
        "monitor", "render", "-o", str(out), "--recipe", SMOL, "k8s.name=demo", "--release", "prom"
    )
    assert result.code == 0, result.err
    docs = [d for p in sorted(out.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    kinds = sorted(d["kind"] for d in docs if d["kind"] != "Kustomization")
    assert kinds == ["ConfigMap"] * 4 + ["PodMonitor", "PrometheusRule", "ServiceMonitor"]
    objects = [d for d in docs if d["kind"] != "Kustomization"]
    assert {o["metadata"]["labels"]["release"] for o in objects} == {"prom"}
    dashboards = [o for o in objects if o["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert len(dashboards) == 3 and all(o["metadata"]["namespace"] == "monitoring" for o in dashboards)
    assert "rules.yaml" in _one([o for o in objects if "adapter" in o["metadata"]["name"]], "ConfigMap")["data"]
    assert "prom" in result.err and "kubectl apply -k" in result.err


def test_monitor_render_without_a_recipe_and_its_errors(tmp_path):
    result = run_cli_redirected("monitor", "render", "-o", str(tmp_path / "a"), "-n", "grafana")
    assert result.code == 0, result.err
    kinds = sorted(p.name.split("-")[0] for p in (tmp_path / "a").glob("*.yaml"))
    assert "podmonitor" not in kinds and "prometheusrule" in kinds
    bad = run_cli_redirected("monitor", "render", "-o", str(tmp_path / "b"), "k8s.name=x")
    assert bad.code == 2 and bad.err.strip() == "kubetune: error: k8s.name=x: overrides need --recipe RECIPE"
