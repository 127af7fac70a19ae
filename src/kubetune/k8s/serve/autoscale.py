"""The HorizontalPodAutoscaler, and prometheus-adapter's rule that gives it the waiting requests
per pod (`kubetune.contracts.prometheus_adapter`) as a ConfigMap beside the server."""

from __future__ import annotations

from kubetune.contracts.kube import KubeObject
from kubetune.contracts.prometheus_adapter import QUEUE_METRIC, adapter_rule_data
from kubetune.k8s.names import AUTOSCALING_COMPONENT
from kubetune.k8s.serve.plan import Plan


def autoscaler(plan: Plan) -> KubeObject:
    """Waiting requests per pod (a queue means the pods are full), with CPU as the fallback: the
    HPA takes the larger of the two, and where one cannot be read it still scales up on the
    other (it then skips scaling down, Kubernetes' rule for a missing metric)."""
    settings = plan.settings
    lo, hi = settings.replica_range()
    cpu = {
        "type": "Resource",
        "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": settings.cpu_target}},
    }
    queue = {
        "type": "Pods",
        "pods": {
            "metric": {"name": QUEUE_METRIC},
            "target": {"type": "AverageValue", "averageValue": str(settings.queue_target)},
        },
    }
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": plan.meta(plan.names.job, AUTOSCALING_COMPONENT),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": plan.names.job},
            "minReplicas": lo,
            "maxReplicas": hi,
            "metrics": [queue, cpu] if settings.autoscale == "queue" else [cpu],
            # a loaded pod is expensive to bring back: scale down slowly, one pod at a time
            "behavior": {
                "scaleDown": {
                    "stabilizationWindowSeconds": 600,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
                }
            },
        },
    }


def adapter_rule_config_map(plan: Plan) -> KubeObject:
    """`adapter_rule_data` as a ConfigMap. Merge it into the adapter's configuration; applying
    this ConfigMap alone configures nothing."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": plan.meta(f"{plan.names.job}-prometheus-adapter-rule", AUTOSCALING_COMPONENT),
        "data": adapter_rule_data(),
    }
