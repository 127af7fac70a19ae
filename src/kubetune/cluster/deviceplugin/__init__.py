"""Kubelet device plugin: a gRPC server that only translates what `kubetune.cluster.devices` finds.

The constants here are importable without grpc (manifests use them).
"""

from pathlib import Path

DEFAULT_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = "kubelet.sock"
DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
