"""The DRA driver (`kubetune dra-driver`): the same cards as the device plugin, as Kubernetes 1.34+
allocates them.

- `slices`: cards + health -> resource.k8s.io/v1 ResourceSlice dicts (pure);
- `publish`: creates / updates / deletes this node's slices through the API server;
- `cdi`: the CDI spec file of one prepared claim, and the checkpoint of prepared claims;
- `server`: the kubelet's DRAPlugin (v1, v1beta1) and Registration services on unix sockets,
  the health loop that republishes the slice, and the lifecycle.

Names (driver, DeviceClass, attributes) come from `kubetune.contracts.dra`, which the claims side reads
too. The constants here are importable without grpc (manifests use them).
"""

from pathlib import Path

DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_CDI_DIR = Path("/var/run/cdi")
