"""Where the API server is and which namespace a command works in, as kubectl finds them.

`load_config` reads the client configuration (a kubeconfig, or inside a pod its service
account) on every call; `resolve_namespace` picks the namespace in kubectl's order from the
same source. The kubernetes library is imported inside the functions: importing kubetune's
command table does not pay for it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from kubetune.errors import UserError

if TYPE_CHECKING:
    from kubernetes.client import Configuration

__all__ = ["SERVICE_ACCOUNT_NAMESPACE", "ClusterError", "load_config", "resolve_namespace"]


class ClusterError(UserError):
    """The cluster cannot be reached, refuses, or lacks what kubetune needs."""


def load_config() -> Configuration:
    """Client configuration: $KUBECONFIG if set, else the pod's service account inside a cluster, else ~/.kube/config.

    $KUBECONFIG is read on every call (the kubernetes library freezes its default path when it
    is first imported) and may list several files (`a:b`). No configuration -> ClusterError.
    """
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        if _in_cluster():
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=_kubeconfig_path(), client_configuration=configuration)
    except config.ConfigException as e:
        raise ClusterError(
            f"no Kubernetes configuration ({e}): set KUBECONFIG, create ~/.kube/config, or run inside a cluster"
        ) from None
    return configuration


def _in_cluster() -> bool:
    """In a pod, unless a kubeconfig is named: then that wins, as for kubectl."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and not os.environ.get("KUBECONFIG")


def _kubeconfig_path() -> str:
    return os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")  # `a:b` merges, as kubectl does


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
    if _in_cluster():
        return _service_account_namespace()
    return _context_namespace()


def _context_namespace() -> str:
    from kubernetes import config

    path = _kubeconfig_path()
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
