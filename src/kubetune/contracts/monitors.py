"""PodMonitor and ServiceMonitor objects (monitoring.coreos.com/v1), as plain dicts.

The shapes every kubetune monitor shares: the `release` label kube-prometheus-stack selects
on, one endpoint on a named port, and the namespace it watches. Standard library and
`kubetune.contracts.kube` only, so that the cluster components (`kubetune.cluster.manifests`, which must
not import the recipe) render their monitors with the same code as the job and the server.
"""

from __future__ import annotations

from typing import Any

from kubetune.contracts.kube import KubeObject
from kubetune.contracts.metrics import METRICS_PATH, RELEASE_LABEL

API_VERSION = "monitoring.coreos.com/v1"
MONITOR_KINDS = ("PodMonitor", "ServiceMonitor")
RULE_KIND = "PrometheusRule"
MONITORING_COMPONENT = "monitoring"  # the `component` label of the rules, dashboards and a job's PodMonitor
# The scrape jobs the Prometheus Operator generates are named `<kind>/<namespace>/<name>/<index>`
# (podMonitor/..., serviceMonitor/...): `kubetune monitor check` finds a monitor's job by it.
OPERATOR_JOB_PREFIX = {"PodMonitor": "podMonitor", "ServiceMonitor": "serviceMonitor"}


def monitor_meta(name: str, namespace: str, labels: dict[str, str], release: str) -> KubeObject:
    """Metadata carrying `release: <release>`; without it kube-prometheus-stack ignores the object."""
    return {"name": name, "namespace": namespace, "labels": {**labels, RELEASE_LABEL: release}}


def endpoint(port: str, relabelings: list[KubeObject] | None = None, **extra: Any) -> KubeObject:
    """One scrape endpoint: a named port, kubetune's metrics path, the given relabelings."""
    out: KubeObject = {"port": port, "path": METRICS_PATH}
    if relabelings:
        out["relabelings"] = relabelings
    return {**out, **extra}


def node_relabeling() -> KubeObject:
    """The pod's Kubernetes node into `node`: what node-exporter and the accelerator panels join on."""
    return {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node", "action": "replace"}


def pod_monitor(meta: KubeObject, selector: dict[str, str], endpoints: list[KubeObject]) -> KubeObject:
    """Scrapes the pods of `meta`'s namespace that carry `selector`'s labels (each pod, not a Service)."""
    spec: KubeObject = {
        "selector": {"matchLabels": dict(selector)},
        "namespaceSelector": {"matchNames": [meta["namespace"]]},
        "podMetricsEndpoints": endpoints,
    }
    return {"apiVersion": API_VERSION, "kind": "PodMonitor", "metadata": meta, "spec": spec}


def service_monitor(meta: KubeObject, selector: dict[str, str], endpoints: list[KubeObject]) -> KubeObject:
    """Scrapes every endpoint of the Services of `meta`'s namespace that carry `selector`'s labels."""
    spec: KubeObject = {
        "selector": {"matchLabels": dict(selector)},
        "namespaceSelector": {"matchNames": [meta["namespace"]]},
        "endpoints": endpoints,
    }
    return {"apiVersion": API_VERSION, "kind": "ServiceMonitor", "metadata": meta, "spec": spec}


def operator_job_prefix(obj: KubeObject) -> str:
    """The prefix of the scrape jobs the Prometheus Operator generates for monitor `obj`."""
    meta = obj["metadata"]
    return f"{OPERATOR_JOB_PREFIX[obj['kind']]}/{meta.get('namespace', '')}/{meta['name']}/"
