"""The one module that talks to a Kubernetes API server.

`KubeClient` is a small boundary: get / create / patch / delete / list any kind kubetune
renders or reads, pod logs, and exec (for copying files out of the data-access pod). All
objects are plain dicts, as rendered. Tests swap this boundary (or point it at an
in-memory API server); nothing else in kubetune.k8s imports the kubernetes client's API
layer (the cluster components watch and patch through `kubetune.contracts.kube.core_v1_api`).

Configuration comes from `kubetune.contracts.kube.load_config` (the loader the cluster components use
too), and `resolve_namespace` picks the namespace a command works in from the same source,
in kubectl's order. Errors talking to the API become `ClusterError` (a UserError: one line,
exit 2): no configuration, unreachable server, 401/403, missing CRDs. `get` returns None on 404.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import yaml

from kubetune.contracts.kube import ClusterError, load_config

__all__ = [
    "KINDS",
    "ClusterError",
    "Conflict",
    "Kind",
    "KubeClient",
    "NotFound",
    "connect",
    "kind_of",
    "load_config",
    "resolve_namespace",
]


class NotFound(ClusterError):
    pass


class Conflict(ClusterError):
    """409: the object already exists (create) or changed meanwhile."""


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
        Kind("resource.k8s.io/v1", "ResourceClaimTemplate", "resourceclaimtemplates", True, "Kubernetes 1.34+ (DRA)"),
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


def _path(kind: Kind, namespace: str | None, name: str | None = None) -> str:
    path = kind.base_path
    if kind.namespaced and namespace is not None:  # None: every namespace (list only)
        path += f"/namespaces/{namespace}"
    path += f"/{kind.plural}"
    return f"{path}/{name}" if name else path


# Where a pod's service account token is mounted, beside the namespace the pod runs in.
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def resolve_namespace(flag: str | None, recipe_namespace: str | None = None) -> str:
    """kubectl's order: -n, else the recipe's k8s.namespace when the recipe sets it, else the
    namespace of the configuration `load_config` connects with (the kubeconfig's current
    context, or in a pod its service account's), else `default`."""
    if flag:
        return flag
    if recipe_namespace:
        return recipe_namespace
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        return _service_account_namespace()
    return _context_namespace()


def _context_namespace() -> str:
    from kubernetes import config

    path = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")  # `a:b` merges, as kubectl does
    try:
        _, current = config.list_kube_config_contexts(config_file=path)
    except (config.ConfigException, OSError):
        return "default"  # no kubeconfig: connecting fails next, with the error that says what to set
    except yaml.YAMLError as e:
        raise ClusterError(f"the kubeconfig {path} is not valid YAML: {' '.join(str(e).split())}") from None
    return ((current or {}).get("context") or {}).get("namespace") or "default"


def _service_account_namespace() -> str:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def connect() -> KubeClient:
    """The client the CLI uses (tests replace this function or point KUBECONFIG elsewhere)."""
    return KubeClient(load_config())


def _subset(want, have) -> bool:
    """True when every field of `want` is present and equal in `have` (server adds defaults)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(_subset, want, have))
    return want == have


class KubeClient:
    def __init__(self, configuration=None):
        from kubernetes import client

        self._api = client.ApiClient(configuration or load_config())
        self.host = self._api.configuration.host

    # ------------------------------------------------------------------ the one HTTP funnel
    def _call(
        self,
        method: str,
        path: str,
        *,
        body=None,
        query=None,
        content_type="application/json",
        what: str = "",
        preload: bool = True,
    ):
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            return self._api.call_api(
                path,
                method,
                query_params=list((query or {}).items()),
                header_params=headers,
                body=body,
                response_type="object" if preload else None,
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _preload_content=preload,
                _request_timeout=(10, None if not preload else 60),
            )
        except ApiException as e:
            raise self._api_error(e, what or f"{method} {path}") from None
        except HTTPError as e:
            raise ClusterError(f"cannot reach the Kubernetes API at {self.host}: {type(e).__name__}: {e}") from None

    def _api_error(self, e, what: str) -> ClusterError:
        try:
            message = json.loads(e.body or "{}").get("message") or e.reason
        except (ValueError, AttributeError):
            message = e.reason
        if e.status == 404:
            return NotFound(f"{what}: not found ({message})")
        if e.status == 409:
            return Conflict(f"{what}: conflict ({message})")
        if e.status in (401, 403):
            return ClusterError(
                f"{what}: {'forbidden' if e.status == 403 else 'unauthorized'} ({message}); "
                "check your kubeconfig user and its RBAC permissions in this namespace"
            )
        return ClusterError(f"{what}: the API server answered {e.status} {e.reason} ({message})")

    # ------------------------------------------------------------------ objects
    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict | None:
        k = kind_of(api_version, kind)
        try:
            return self._call("GET", _path(k, namespace, name), what=f"get {kind} {name}")
        except NotFound:
            return None

    def create(self, obj: dict) -> dict:
        k = kind_of(obj["apiVersion"], obj["kind"])
        ns = obj["metadata"].get("namespace")
        try:
            return self._call("POST", _path(k, ns), body=obj, what=f"create {k.kind} {obj['metadata']['name']}")
        except NotFound as e:
            hint = f": is {k.install_hint} installed?" if k.install_hint else ""
            raise NotFound(f"{e}{hint}") from None  # still a ClusterError; submit skips absent monitoring kinds

    def patch(self, obj: dict) -> dict:
        """JSON merge patch of the whole rendered object (no resourceVersion, no replace)."""
        k = kind_of(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        return self._call(
            "PATCH",
            _path(k, meta.get("namespace"), meta["name"]),
            body=obj,
            content_type="application/merge-patch+json",
            what=f"update {k.kind} {meta['name']}",
        )

    def patch_status(self, api_version: str, kind: str, name: str, namespace: str | None, status: dict) -> dict:
        """JSON merge patch of the status subresource."""
        k = kind_of(api_version, kind)
        return self._call(
            "PATCH",
            _path(k, namespace, name) + "/status",
            body={"status": status},
            content_type="application/merge-patch+json",
            what=f"update status of {kind} {name}",
        )

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        """Delete (pods of a job go with it: propagation Background); False if it was absent."""
        k = kind_of(api_version, kind)
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        try:
            self._call("DELETE", _path(k, namespace, name), body=body, what=f"delete {kind} {name}")
        except NotFound:
            return False
        return True

    def list(
        self, api_version: str, kind: str, namespace: str | None = None, labels: dict[str, str] | None = None
    ) -> list[dict]:
        k = kind_of(api_version, kind)
        query = {"labelSelector": ",".join(f"{a}={b}" for a, b in labels.items())} if labels else None
        try:
            items = self._call("GET", _path(k, namespace), query=query, what=f"list {k.plural}").get("items") or []
        except NotFound:
            return []
        # Filter here too: selectors are a server-side optimisation, not something to trust blindly.
        return [o for o in items if _subset(labels or {}, (o.get("metadata") or {}).get("labels") or {})]

    def apply(self, obj: dict, immutable: bool = False) -> str:
        """Create, or merge-patch when it differs: created | configured | unchanged | kept."""
        meta = obj["metadata"]
        live = self.get(obj["apiVersion"], obj["kind"], meta["name"], meta.get("namespace"))
        if live is None:
            self.create(obj)
            return "created"
        if _subset(obj, live):
            return "unchanged"
        if immutable:
            return "kept"
        self.patch(obj)
        return "configured"

    # ------------------------------------------------------------------ pods
    def pod_log(
        self,
        pod: str,
        namespace: str,
        container: str | None = None,
        tail_lines: int | None = None,
        follow: bool = False,
    ) -> Iterator[str]:
        """The container's log, line by line (follows until the container ends with follow=True)."""
        query: dict = {"follow": "true" if follow else "false"}
        if container:
            query["container"] = container
        if tail_lines:
            query["tailLines"] = str(tail_lines)
        response = self._call(
            "GET",
            _path(KINDS[("v1", "Pod")], namespace, pod) + "/log",
            query=query,
            what=f"logs of pod {pod}",
            preload=False,
        )
        pending = b""
        try:
            for chunk in response.stream(4096):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                yield from (line.decode("utf-8", "replace") for line in lines)
            if pending:
                yield pending.decode("utf-8", "replace")
        finally:
            response.release_conn()

    def exec_to(
        self, pod: str, namespace: str, command: Sequence[str], sink: IO[bytes], container: str | None = None
    ) -> str:
        """Run `command` in the pod, stdout (binary) into `sink`; returns stderr. Like `kubectl exec`.

        Built on the client's WSClient directly rather than `kubernetes.stream.stream`, which
        always keeps a second in-memory copy of everything received (capture_all): a run
        directory with checkpoints is gigabytes.
        """
        from kubernetes.stream.ws_client import WSClient, get_websocket_url

        query = [("command", command), ("stdout", "true"), ("stderr", "true"), ("stdin", "false"), ("tty", "false")]
        if container:
            query.append(("container", container))
        url = get_websocket_url(self.host + _path(KINDS[("v1", "Pod")], namespace, pod) + "/exec", query)
        headers = {}
        token = (self._api.configuration.auth_settings().get("BearerToken") or {}).get("value")
        if token:
            headers["authorization"] = token
        try:
            ws = WSClient(self._api.configuration, url, headers, capture_all=False, binary=True)
        except Exception as e:  # websocket handshake errors (403, 404, refused) share no base class
            raise ClusterError(f"exec in pod {namespace}/{pod} failed: {e}") from None
        stderr = b""
        try:
            while ws.is_open():
                ws.update(timeout=1)
                if ws.peek_stdout():
                    sink.write(ws.read_stdout())
                if ws.peek_stderr():
                    stderr += ws.read_stderr()
            code = ws.returncode
        except Exception as e:
            raise ClusterError(f"exec in pod {namespace}/{pod} broke off: {type(e).__name__}: {e}") from None
        finally:
            ws.close()
        if code:
            raise ClusterError(
                f"`{' '.join(command)}` in pod {pod} exited {code}: {stderr.decode(errors='replace').strip()}"
            )
        return stderr.decode(errors="replace")
