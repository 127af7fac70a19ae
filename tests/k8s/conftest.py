"""Fixtures for the k8s tests: the CLI run in-process, and an in-memory Kubernetes API.

`kube` serves kmock's KubernetesEmulator over real loopback HTTP (tests/kit/kube.py); kubetune
reaches it through the real kubernetes client and a kubeconfig file in $KUBECONFIG, exactly as
it would reach a cluster. kmock's sharp edges (see ../shared/reference/kubernetes.md section 9)
are handled here: resources are declared up front, namespaces (not emulated) are scripted,
selectors are ignored by kmock (kubetune filters labels itself), and pod logs are scripted
reactions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.kit.cli import run_cli_redirected
from tests.kit.kube import KmockServer

TOKEN = "hf_TESTtoken0123456789abcdefghijklmnopq"  # shaped like a real token (37 chars)


@pytest.fixture
def crd_dir() -> Path:
    """The CRDs kubetune ships (`kubetune/k8s/crds/`): what `render --check` validates against,
    in a fresh clone as in an installed package."""
    from kubetune.k8s.validate import vendored_crd_dir

    return vendored_crd_dir()


@pytest.fixture
def cli():
    return run_cli_redirected


# ---------------------------------------------------------------------------- in-memory API

RESOURCES = {
    "v1/pods": ("Pod", True),
    "v1/configmaps": ("ConfigMap", True),
    "v1/secrets": ("Secret", True),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", True),
    "v1/events": ("Event", True),
    "v1/resourcequotas": ("ResourceQuota", True),
    "v1/services": ("Service", True),
    "apps/v1/deployments": ("Deployment", True),
    "networking.k8s.io/v1/ingresses": ("Ingress", True),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True),
    "autoscaling/v2/horizontalpodautoscalers": ("HorizontalPodAutoscaler", True),
    "scheduling.k8s.io/v1/priorityclasses": ("PriorityClass", False),
    "storage.k8s.io/v1/storageclasses": ("StorageClass", False),
    "kubeflow.org/v1/pytorchjobs": ("PyTorchJob", True),
    "trainer.kubeflow.org/v1alpha1/trainjobs": ("TrainJob", True),
    "trainer.kubeflow.org/v1alpha1/clustertrainingruntimes": ("ClusterTrainingRuntime", False),
    "scheduling.x-k8s.io/v1alpha1/podgroups": ("PodGroup", True),
    "scheduling.volcano.sh/v1beta1/podgroups": ("PodGroup", True),
    "kueue.x-k8s.io/v1beta2/workloads": ("Workload", True),
    "kueue.x-k8s.io/v1beta2/localqueues": ("LocalQueue", True),
    "resource.k8s.io/v1/resourceclaimtemplates": ("ResourceClaimTemplate", True),
}


@dataclass
class Kube:
    emulator: object
    url: str
    kubeconfig: Path

    def client(self):
        from kubernetes import client as kc

        from kubetune.kubeapi import KubeClient

        return KubeClient(kc.Configuration(host=self.url))

    def objects(self, plural: str) -> dict[tuple[str | None, str], dict]:
        """(namespace, name) -> object, for every live object of `plural` ('v1/pods', ...)."""
        out = {}
        for (resource, ns, name), obj in list(self.emulator.objects.items()):
            if (
                not obj.deleted
                and f"{resource.group + '/' if resource.group else ''}{resource.version}/{resource.plural}" == plural
            ):
                out[(ns, name)] = obj.raw
        return out

    def script_log(self, pod: str, text: str) -> None:
        import kmock

        self.emulator["get", kmock.resource("v1", "pods"), kmock.name(pod), kmock.subresource("log")] << text.encode()

    def script_namespace(self, name: str) -> None:
        # kmock does not emulate namespaces: answer the GET the way a cluster that has it would.
        self.emulator[f"get /api/v1/namespaces/{name}"] << {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name},
        }


@pytest.fixture
def kube(tmp_path, monkeypatch):
    import kmock

    server = KmockServer(
        {plural: kmock.ResourceInfo(kind=kind, namespaced=ns) for plural, (kind, ns) in RESOURCES.items()}
    )
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(server.kubeconfig("tester", namespace="kubetune"))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    kube = Kube(server.emulator, server.url, kubeconfig)
    kube.script_namespace("kubetune")
    yield kube
    server.stop()
