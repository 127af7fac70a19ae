"""Every kind kubetune reads or writes, and the URL path of its objects.

A kind missing here is refused by name (`kind_of`), before any request: the table is the list
of what kubetune asks an API server for, which the components' and the operator's RBAC follow.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubetune.kubeapi.config import ClusterError

__all__ = ["KINDS", "Kind", "api_path", "kind_of"]


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool
    install_hint: str = ""

    @property
    def base_path(self) -> str:
        return f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"


DRA = "Kubernetes 1.34+ (DRA)"

KINDS = {
    (k.api_version, k.kind): k
    for k in (
        Kind("v1", "Namespace", "namespaces", False),
        Kind("v1", "ConfigMap", "configmaps", True),
        Kind("v1", "Secret", "secrets", True),
        Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims", True),
        Kind("v1", "Pod", "pods", True),
        Kind("v1", "ResourceQuota", "resourcequotas", True),
        Kind("v1", "Event", "events", True),
        Kind("v1", "Node", "nodes", False),
        Kind("v1", "Service", "services", True),
        Kind("apps/v1", "Deployment", "deployments", True),
        Kind("batch/v1", "Job", "jobs", True),
        Kind("resource.k8s.io/v1", "ResourceClaimTemplate", "resourceclaimtemplates", True, DRA),
        Kind("resource.k8s.io/v1", "ResourceClaim", "resourceclaims", True, DRA),
        Kind("resource.k8s.io/v1", "ResourceSlice", "resourceslices", False, DRA),
        Kind("networking.k8s.io/v1", "Ingress", "ingresses", True),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies", True),
        Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets", True),
        Kind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers", True),
        Kind("scheduling.k8s.io/v1", "PriorityClass", "priorityclasses", False),
        Kind("storage.k8s.io/v1", "StorageClass", "storageclasses", False),
        Kind("kubeflow.org/v1", "PyTorchJob", "pytorchjobs", True, "the Kubeflow training operator (v1.9)"),
        Kind("trainer.kubeflow.org/v1alpha1", "TrainJob", "trainjobs", True, "Kubeflow Trainer v2"),
        Kind(
            "trainer.kubeflow.org/v1alpha1",
            "ClusterTrainingRuntime",
            "clustertrainingruntimes",
            False,
            "Kubeflow Trainer v2",
        ),
        Kind(
            "scheduling.x-k8s.io/v1alpha1", "PodGroup", "podgroups", True, "the scheduler-plugins coscheduling plugin"
        ),
        Kind("scheduling.volcano.sh/v1beta1", "PodGroup", "podgroups", True, "Volcano"),
        *(
            Kind("monitoring.coreos.com/v1", kind, plural, True, "the Prometheus Operator (kube-prometheus-stack)")
            for kind, plural in (
                ("PodMonitor", "podmonitors"),
                ("ServiceMonitor", "servicemonitors"),
                ("PrometheusRule", "prometheusrules"),
                ("Prometheus", "prometheuses"),
            )
        ),
        Kind("kubetune.io/v1alpha1", "FineTune", "finetunes", True, "kubetune's FineTune CRD and operator"),
        Kind("kubetune.io/v1alpha1", "ModelServer", "modelservers", True, "kubetune's ModelServer CRD and operator"),
        Kind(
            "inference.networking.k8s.io/v1",
            "InferencePool",
            "inferencepools",
            True,
            "the Gateway API Inference Extension (v1.0 or newer)",
        ),
        Kind(
            "inference.networking.x-k8s.io/v1alpha2",
            "InferenceObjective",
            "inferenceobjectives",
            True,
            "the Gateway API Inference Extension (v1.0 to v1.5)",
        ),
        *(
            Kind("kueue.x-k8s.io/v1beta2", kind, plural, namespaced, "Kueue (v0.19 or newer)")
            for kind, plural, namespaced in (
                ("LocalQueue", "localqueues", True),
                ("ClusterQueue", "clusterqueues", False),
                ("ResourceFlavor", "resourceflavors", False),
                ("Topology", "topologies", False),
                ("Workload", "workloads", True),
            )
        ),
    )
}


def kind_of(api_version: str, kind: str) -> Kind:
    try:
        return KINDS[(api_version, kind)]
    except KeyError:
        raise ClusterError(f"kubetune does not know the kind {kind} {api_version}") from None


def api_path(kind: Kind, namespace: str | None, name: str | None = None) -> str:
    """The collection's path, or one object's. A namespace of None lists every namespace."""
    path = kind.base_path
    if kind.namespaced and namespace is not None:
        path += f"/namespaces/{namespace}"
    path += f"/{kind.plural}"
    return f"{path}/{name}" if name else path
