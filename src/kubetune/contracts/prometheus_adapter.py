"""prometheus-adapter's rule for the serving autoscaler: the waiting requests of each pod
(`WAITING_METRIC`, vLLM's gauge, which both engines export) under a name Kubernetes accepts, as the
adapter's config file and as values of its Helm chart. `k8s render-serve --autoscale queue` and
`kubetune monitor render` ship it; the HorizontalPodAutoscaler asks for QUEUE_METRIC."""

from __future__ import annotations

import re

import yaml

from kubetune.contracts.kube import KubeObject
from kubetune.contracts.serving import WAITING_METRIC

# The custom metric the HPA asks for: WAITING_METRIC as prometheus-adapter renames it (a Kubernetes
# metric name cannot hold ':').
QUEUE_METRIC = WAITING_METRIC.replace(":", "_")


def adapter_rule() -> KubeObject:
    """prometheus-adapter's rule: the gauge per pod, under a name Kubernetes accepts."""
    return {
        "seriesQuery": f'{WAITING_METRIC}{{namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{re.escape(WAITING_METRIC)}$", "as": QUEUE_METRIC},
        "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
    }


def adapter_rule_data() -> dict[str, str]:
    """The rule twice: in the adapter's own config file (under `rules:`) and as values of the
    prometheus-community/prometheus-adapter Helm chart (`rules.custom`)."""
    rule = adapter_rule()

    def dump(data: KubeObject) -> str:
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=200)

    return {"rules.yaml": dump({"rules": [rule]}), "helm-values.yaml": dump({"rules": {"custom": [rule]}})}
