"""kubetune.kubeapi.config: the one kubeconfig loader, read at call time, and a pod's service account."""

from __future__ import annotations

import pytest
import yaml

from kubetune.kubeapi import ClusterError, connect, load_config


def _kubeconfig(path, server):
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t0ken"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    return path


def test_kubeconfig_is_read_at_call_time_and_wins_inside_a_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "a", "https://a.example:6443")))
    assert load_config().host == "https://a.example:6443"
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "b", "https://b.example:6443")))
    configuration = load_config()
    assert configuration.host == "https://b.example:6443"
    assert configuration.api_key["authorization"] == "Bearer t0ken"


def test_in_cluster_service_account(tmp_path, monkeypatch):
    from kubernetes.client import Configuration
    from kubernetes.config import incluster_config

    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "ca.crt").write_text("not a real CA")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    default_before = Configuration.get_default_copy().host
    configuration = load_config()
    assert configuration.host == "https://10.0.0.1:443"
    assert configuration.api_key["authorization"].lower() == "bearer sa-token"  # the library writes "bearer"
    assert configuration.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert Configuration.get_default_copy().host == default_before  # the library's global default is left alone


def test_no_configuration_is_a_cluster_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ClusterError, match="no Kubernetes configuration"):
        load_config()
    monkeypatch.delenv("KUBECONFIG")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config either
    with pytest.raises(ClusterError, match="no Kubernetes configuration"):
        load_config()


def test_connect_uses_the_loader(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "k", "https://k.example:6443")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert connect().host == "https://k.example:6443"
