"""The alert rules and the dashboards as Prometheus Operator and Grafana objects, plain dicts
(pure: no API calls, no kubernetes import): `prometheus_rule` and `dashboard_config_maps`
(`kubetune monitor render`); the Grafana sidecar of kube-prometheus-stack loads ConfigMaps
labelled `grafana_dashboard: "1"`.

The monitors of a job and a server select by the job's names, so they are `kubetune.k8s`'s
(`kubetune.k8s.scrape`); this module knows no job. Every object carries
`release: <monitor.release>`: kube-prometheus-stack's Prometheus selects rules by that label
and ignores the rest without a word.
"""

from __future__ import annotations

from kubetune.contracts import monitors
from kubetune.contracts.kube import KUBETUNE, KubeObject, common_labels
from kubetune.contracts.metrics import DASHBOARD_LABEL
from kubetune.monitor.dashboards import dashboards, to_text
from kubetune.monitor.rules import RuleSettings, rule_groups

RULE_NAME = "kubetune-alerts"


def _meta(name: str, namespace: str, release: str, extra: dict[str, str] | None = None) -> KubeObject:
    labels = common_labels(KUBETUNE, monitors.MONITORING_COMPONENT, managed_by=KUBETUNE)
    return monitors.monitor_meta(name, namespace, {**labels, **(extra or {})}, release)


def prometheus_rule(namespace: str, release: str, settings: RuleSettings | None = None) -> KubeObject:
    return {
        "apiVersion": monitors.API_VERSION,
        "kind": monitors.RULE_KIND,
        "metadata": _meta(RULE_NAME, namespace, release),
        "spec": {"groups": rule_groups(settings)},
    }


def dashboard_config_maps(namespace: str, release: str) -> list[KubeObject]:
    """One ConfigMap per dashboard, in the Grafana sidecar's convention."""
    key, value = DASHBOARD_LABEL
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(f"{d.uid}-dashboard", namespace, release, {key: value}),
            "data": {f"{d.uid}.json": to_text(d)},
        }
        for d in dashboards()
    ]
