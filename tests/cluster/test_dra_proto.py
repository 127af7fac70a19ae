"""The DRA driver's protos are upstream's, byte for byte, and the generated code serves the method names
the kubelet dials."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kubetune.cluster.dra import proto

# sha256 of pkg/apis/{dra/v1,dra/v1beta1,dra-health/v1alpha1,pluginregistration/v1}/api.proto at
# kubernetes/kubelet tag kubernetes-1.36.3 (the provenance table in proto/__init__.py)
UPSTREAM = {
    "dra_v1.proto": "b3066ad7f6abcfd0003c47b06ceb801d76997d78d6be505597478d3905b9cc57",
    "dra_v1beta1.proto": "7900b11793ad897d0375d67b3bbae675869b574e21dfb1bf5334cc1556138c42",
    "dra_health_v1alpha1.proto": "75f8c523ec546ceb83bd63f3b7a38c23d979494e7015db12d146e2f39dd4528e",
    "pluginregistration.proto": "7a67a0000a1a167c155286834bc9ccb489f8bcdb394e006daba270189c272afa",
}


@pytest.mark.parametrize("name", UPSTREAM)
def test_the_proto_is_upstreams(name):
    assert hashlib.sha256((Path(proto.__file__).parent / name).read_bytes()).hexdigest() == UPSTREAM[name]


def test_the_generated_services_have_the_kubelets_full_names():
    from kubetune.cluster.dra.proto import dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2

    def methods(module, service: str) -> set[str]:
        desc = module.DESCRIPTOR.services_by_name[service]
        return {f"/{desc.full_name}/{m.name}" for m in desc.methods}

    assert methods(dra_v1_pb2, "DRAPlugin") == {
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
    }
    assert methods(dra_v1beta1_pb2, "DRAPlugin") == {
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
    }
    assert methods(pluginregistration_pb2, "Registration") == {
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    }
