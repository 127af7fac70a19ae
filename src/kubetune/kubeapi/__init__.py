"""The one way kubetune talks to a Kubernetes API server: `KubeClient`, on plain dicts.

Below both sides that talk to a cluster: `kubetune.k8s` (submit, status, logs, download,
delete, doctor; the operator and `kubetune monitor` through them) and `kubetune.cluster` (the
device plugin's and netprobe's Node patches, the DRA driver's ResourceSlices and
ResourceClaims, the scheduler extender's watch of pods and nodes). Neither imports the
kubernetes library's typed API classes: one client, one error type, one kubeconfig loader.

- `config.py`: `load_config` (kubeconfig, or the pod's service account) and `resolve_namespace`
  (kubectl's order), `ClusterError`.
- `kinds.py`: every kind kubetune reads or writes and its URL path.
- `client.py`: `KubeClient` (get, create, patch, json_patch, patch_status, delete, list,
  apply, watch, pod_log, exec_to), `NotFound` / `Conflict` / `Gone`, `connect`.
- `watch.py`: what a watch yields (`Listed`, `WatchEvent`).

The kubernetes library is imported inside the functions that talk to a server.
"""

from kubetune.kubeapi.client import Conflict, Gone, KubeClient, NotFound, connect
from kubetune.kubeapi.config import ClusterError, load_config, resolve_namespace
from kubetune.kubeapi.kinds import KINDS, Kind, kind_of
from kubetune.kubeapi.watch import Listed, WatchEvent

__all__ = [
    "KINDS",
    "ClusterError",
    "Conflict",
    "Gone",
    "Kind",
    "KubeClient",
    "Listed",
    "NotFound",
    "WatchEvent",
    "connect",
    "kind_of",
    "load_config",
    "resolve_namespace",
]
