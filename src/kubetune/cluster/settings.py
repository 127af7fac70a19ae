"""What each cluster daemon (`kubetune pod device-plugin | dra-driver | scheduler-extender | netprobe`)
is started with: one frozen dataclass per daemon, each field with its default, flag and help
(`kubetune.flags.setting`), from which `kubetune.cluster.cli` makes the daemon's options.

One module for the four, not one in each daemon's package: they share flags (node name, discovery,
device root, health interval, log level), declared once here, and the daemon packages stay free of
typer. Defaults that other code uses too are the constants of the daemon's package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetune.cluster import nodefacts as keys
from kubetune.cluster.deviceplugin import DEFAULT_PLUGIN_DIR, DEFAULT_POD_RESOURCES_SOCKET
from kubetune.cluster.dra import DEFAULT_CDI_DIR, DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR
from kubetune.cluster.extender import DEFAULT_PORT as EXTENDER_PORT
from kubetune.cluster.manifests import NETPROBE_NAME, ComponentSettings
from kubetune.cluster.netprobe import DEFAULT_PORT as NETPROBE_PORT
from kubetune.contracts.kube import NAME
from kubetune.flags import setting

SYSFS_ROOT = Path("/sys")
DEV_ROOT = Path("/dev")
DEV_ROOT_HELP = "Root of the device nodes probed for health."
ANY_ADDRESS = "0.0.0.0"  # where the servers listen: every interface of the pod


# The flags several daemons take: a function each, since a dataclass field belongs to one class.
def _discovery() -> Any:
    return setting(ComponentSettings.discovery, "--discovery", "sysfs (Gaudi) | nvml (NVIDIA) | inventory:FILE (demo).")


def _node_name() -> Any:
    return setting(None, "--node-name", "This node's name (default $NODE_NAME).", envvar="NODE_NAME")


def _health_interval() -> Any:
    return setting(5.0, "--health-interval", "Seconds between health probes.")


def _log_level() -> Any:
    return setting("info", "--log-level", "")


@dataclass(frozen=True)
class DevicePluginSettings:
    resource: str = setting(ComponentSettings.resource, "--resource", "Extended resource to advertise.")
    discovery: str = _discovery()
    plugin_dir: Path = setting(DEFAULT_PLUGIN_DIR, "--plugin-dir", "Directory with kubelet.sock.")
    sysfs_root: Path = setting(SYSFS_ROOT, "--sysfs-root", "Root of the sysfs tree (a fake tree in tests).")
    dev_root: Path = setting(DEV_ROOT, "--dev-root", DEV_ROOT_HELP)
    health_interval: float = _health_interval()
    watch_interval: float = setting(1.0, "--watch-interval", "Seconds between looks at the plugin directory.")
    metrics_port: int = setting(0, "--metrics-port", "Serve Prometheus metrics on this port (0 = off).")
    publish_node_facts: bool = setting(
        False, "--publish-node-facts", "Patch this node's annotations/labels (needs RBAC)."
    )
    node_name: str | None = _node_name()
    leaf_label: str | None = setting(
        None, "--leaf-label", f"Node label holding the network leaf; copied to {keys.LEAF_LABEL}."
    )
    pod_resources_socket: Path = setting(
        DEFAULT_POD_RESOURCES_SOCKET, "--pod-resources-socket", "Kubelet PodResources socket (cards in use)."
    )
    publish_interval: float = setting(30.0, "--publish-interval", "Seconds between node fact refreshes.")
    log_level: str = _log_level()


@dataclass(frozen=True)
class DraDriverSettings:
    discovery: str = _discovery()
    node_name: str | None = _node_name()
    registry_dir: Path = setting(DEFAULT_REGISTRY_DIR, "--registry-dir", "The kubelet's plugin registry directory.")
    plugins_dir: Path = setting(DEFAULT_PLUGINS_DIR, "--plugins-dir", "Parent of the driver's own directory.")
    cdi_dir: Path = setting(DEFAULT_CDI_DIR, "--cdi-dir", "Where the CDI spec files are written.")
    kubeconfig: Path | None = setting(
        None, "--kubeconfig", "Kubeconfig file (default: $KUBECONFIG, else the pod's service account)."
    )
    sysfs_root: Path = setting(SYSFS_ROOT, "--sysfs-root", "Root of the sysfs tree (a fake in tests).")
    dev_root: Path = setting(DEV_ROOT, "--dev-root", DEV_ROOT_HELP)
    health_interval: float = _health_interval()
    resync_interval: float = setting(
        60.0, "--resync-interval", "Seconds between checks that this node's ResourceSlices are still there."
    )
    log_level: str = _log_level()


@dataclass(frozen=True)
class ExtenderSettings:
    host: str = setting(ANY_ADDRESS, "--host", "")
    port: int = setting(EXTENDER_PORT, "--port", "")
    weights: str = setting("", "--weights", "Score weights, e.g. fit=3,hbm=1,closeness=5,rdma=1.")
    # empty: the defaults the help names
    resource: tuple[str, ...] = setting(
        (), "--resource", f"Managed resources (repeatable; default {', '.join(keys.MANAGED_RESOURCES)})."
    )
    leaf_label: tuple[str, ...] = setting(
        (), "--leaf-label", f"Node labels naming the network leaf, in order (default {keys.LEAF_LABEL})."
    )
    watch_pods: bool = setting(
        False, "--watch-pods", "Keep a watch-backed pod cache (needs list/watch on pods and nodes)."
    )
    log_level: str = _log_level()


@dataclass(frozen=True)
class NetprobeSettings:
    node_name: str | None = _node_name()
    listen: str = setting(ANY_ADDRESS, "--listen", "Address the echo server answers peers on.")
    port: int = setting(NETPROBE_PORT, "--port", "TCP port of the echo server (the same on every node).")
    peer: tuple[str, ...] = setting(
        (), "--peer", "HOST[:PORT] to measure (repeatable); default: the DaemonSet's other pods, from the API."
    )
    namespace: str | None = setting(
        None, "--namespace", "Namespace of the prober pods (default $POD_NAMESPACE).", envvar="POD_NAMESPACE"
    )
    selector: str = setting(f"{NAME}={NETPROBE_NAME}", "--selector", "Labels of the prober pods.")
    interval: float = setting(60.0, "--interval", "Seconds between measurement rounds.")
    samples: int = setting(20, "--samples", "TCP ping-pongs per peer and round.")
    max_peers: int = setting(16, "--max-peers", "Peers measured per round (a random sample of them).")
    timeout: float = setting(1.0, "--timeout", "Seconds to wait for a peer's answer.")
    rdma: str = setting("auto", "--rdma", "auto: ib_write_lat when perftest and an RDMA device exist; off.")
    annotate: bool = setting(
        True, "--annotate/--no-annotate", "Write the result on this node's Node object (needs RBAC)."
    )
    serve_only: bool = setting(False, "--serve-only", "Only answer other probers; measure nothing.")
    once: bool = setting(False, "--once", "One round: print it as JSON (and annotate), then exit.")
    log_level: str = _log_level()
