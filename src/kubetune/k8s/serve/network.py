"""Who reaches the server: its Service, the NetworkPolicy in front of it, and the Ingress."""

from __future__ import annotations

from kubetune.contracts.kube import KubeObject
from kubetune.contracts.serving import DEFAULT_MAX_BODY_BYTES, DEFAULT_PORT
from kubetune.k8s.serve.plan import PORT_NAME, Plan

INGRESS_TIMEOUT_S = 3600  # a long answer streams for minutes; nginx's default cuts it at 60 s


def service(plan: Plan) -> KubeObject:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": plan.meta(plan.names.job),
        "spec": {
            "type": "ClusterIP",
            "selector": plan.selector,
            "ports": [{"name": PORT_NAME, "port": DEFAULT_PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def network_policy(plan: Plan) -> KubeObject:
    """Who may open the server's port: the namespace's own pods, the ingress controller and
    Prometheus; nobody else. A NetworkPolicy sees ports, not paths, so Prometheus reaches the API
    as well as /metrics (the API key guards the API). The kubelet's probes come from the node, not
    from a pod, and pass. Egress stays open: a hub base model is downloaded at start (HF_HOME)
    and the names it needs resolved, where a run on the claim or in an image needs nothing."""
    settings = plan.settings

    def namespace(name: str) -> KubeObject:
        return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}}}

    peers = [{"podSelector": {}}, namespace(settings.ingress_namespace), namespace(settings.monitoring_namespace)]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": plan.meta(plan.names.job),
        "spec": {
            "podSelector": {"matchLabels": plan.selector},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"port": PORT_NAME, "protocol": "TCP"}]}],
        },
    }


def nginx_size(n_bytes: int) -> str:
    """A byte count in nginx's size syntax (k and m are binary), exactly."""
    for unit, scale in (("m", 1 << 20), ("k", 1 << 10)):
        if n_bytes % scale == 0:
            return f"{n_bytes // scale}{unit}"
    return str(n_bytes)


def _ingress_annotations(plan: Plan) -> dict[str, str]:
    nginx = "nginx.ingress.kubernetes.io"
    annotations = {
        # server-sent events: each token goes out as it is made, not when nginx's buffer fills
        f"{nginx}/proxy-buffering": "off",
        f"{nginx}/proxy-request-buffering": "off",
        f"{nginx}/proxy-read-timeout": str(INGRESS_TIMEOUT_S),
        f"{nginx}/proxy-send-timeout": str(INGRESS_TIMEOUT_S),
        # what the server accepts (--max-body-bytes): a larger body stops at the edge of the cluster
        f"{nginx}/proxy-body-size": nginx_size(DEFAULT_MAX_BODY_BYTES),
    }
    if plan.settings.cert_manager_issuer:
        annotations["cert-manager.io/cluster-issuer"] = plan.settings.cert_manager_issuer
    return annotations


def _ingress_tls(plan: Plan) -> list[KubeObject] | None:
    """TLS for --ingress-host from --ingress-tls-secret, or from the Secret cert-manager writes."""
    settings = plan.settings
    secret = settings.ingress_tls_secret or (f"{plan.names.job}-tls" if settings.cert_manager_issuer else None)
    if secret is None:
        return None
    return [{"hosts": [settings.ingress_host], "secretName": secret}]


def ingress(plan: Plan) -> KubeObject:
    backend = {"service": {"name": plan.names.job, "port": {"name": PORT_NAME}}}
    rule: KubeObject = {"http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": backend}]}}
    if plan.settings.ingress_host:
        rule = {"host": plan.settings.ingress_host, **rule}
    spec: KubeObject = {"ingressClassName": plan.settings.ingress_class, "rules": [rule]}
    tls = _ingress_tls(plan)
    if tls:
        spec["tls"] = tls
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": plan.meta(plan.names.job, annotations=_ingress_annotations(plan)),
        "spec": spec,
    }
