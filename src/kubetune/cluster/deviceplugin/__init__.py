"""Kubelet device plugin: discovery + health (backends) and a gRPC server that only translates.

The constants here are importable without grpc (manifests use them).
"""

from pathlib import Path

DEFAULT_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = "kubelet.sock"
