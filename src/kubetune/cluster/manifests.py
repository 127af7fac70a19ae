"""Manifests of the cluster components (pure: settings in, list of dicts out).

`kubetune k8s render-components` prints them as one YAML stream:

- device plugin: ServiceAccount, ClusterRole (get/patch nodes, to publish facts),
  ClusterRoleBinding, DaemonSet (privileged, hostPath of the plugin and pod-resources
  directories, priorityClassName system-node-critical), on the nodes whose Node Feature
  Discovery PCI labels show the vendor's cards (or `--node-selector`, or `--all-nodes`);
- or, with `--devices dra` (Kubernetes 1.34+), the DRA driver instead of the device plugin:
  ServiceAccount, ClusterRole (resourceslices, resourceclaims get, nodes get), binding,
  DaemonSet (hostPath of the kubelet's plugins_registry and plugins directories and of
  /var/run/cdi at the same paths, NODE_NAME / POD_UID from the downward API) on the same nodes,
  and the vendor's DeviceClass (this driver's healthy cards);
- scheduler extender: ServiceAccount, ClusterRole (list/watch pods and nodes, for the
  optional pod cache), ClusterRoleBinding, Deployment, Service;
- node prober (`kubetune netprobe`, unless `--no-netprobe`): ServiceAccount, ClusterRole
  (get/patch nodes, for the latency annotation), Role (list its own pods, to find its peers),
  both bindings, DaemonSet on the pod network, on the same nodes as the device plugin;
- a ConfigMap holding the KubeSchedulerConfiguration whose `extenders` entry points the
  kube-scheduler at the extender (also printed alone with `--scheduler-config-only`);
- unless `--no-monitors`: a PodMonitor for the device plugin (a DaemonSet: each pod is scraped
  on its `metrics` port, and its node is the pod's, so no Service is needed in front of it)
  and a ServiceMonitor for the extender (its Service's `http` port serves /metrics), both
  labelled `release: <--release>` for kube-prometheus-stack (`kubetune.contracts.monitors`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kubetune import __version__
from kubetune.cluster import nodefacts as keys
from kubetune.cluster.deviceplugin import DEFAULT_PLUGIN_DIR, DEFAULT_POD_RESOURCES_SOCKET
from kubetune.cluster.dra import DEFAULT_CDI_DIR, DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR
from kubetune.cluster.extender import DEFAULT_PORT as EXTENDER_PORT
from kubetune.cluster.netprobe import DEFAULT_PORT as NETPROBE_PORT
from kubetune.contracts import dra, monitors
from kubetune.contracts.kube import KUBETUNE, NAME, common_labels
from kubetune.contracts.metrics import DEFAULT_RELEASE, METRICS_PORT_NAME
from kubetune.errors import UserError
from kubetune.flags import setting

PLUGIN_NAME = "kubetune-device-plugin"
DRA_DRIVER_NAME = "kubetune-dra-driver"
DEVICES = ("plugin", "dra")  # --devices: the device plugin (extended resources) or the DRA driver
EXTENDER_NAME = "kubetune-scheduler-extender"
NETPROBE_NAME = "kubetune-netprobe"
SCHEDULER_CONFIG_NAME = "kubetune-scheduler-config"
POD_RESOURCES_DIR = DEFAULT_POD_RESOURCES_SOCKET.parent.as_posix()  # mounted: the plugin reads the socket in it
POD_COMMAND = ("kubetune", "pod")  # the hidden group of what only pods run; args name the command

# Node Feature Discovery labels a node by the PCI devices it holds (NFD docs, "Feature labels",
# PCI: https://kubernetes-sigs.github.io/node-feature-discovery/stable/usage/features.html#pci):
# `feature.node.kubernetes.io/pci-<device label>.present: "true"`, where <device label> is
# `<class>_<vendor>` by default and `<vendor>` alone under `sources.pci.deviceLabelFields: [vendor]`
# (the setting NVIDIA's GPU Operator deploys NFD with). Only classes in deviceClassWhitelist
# (default 03, 0b40, 12) are labelled: Gaudi is 1200 (processing accelerator), NVIDIA data-centre
# GPUs 0302 (3D controller), other NVIDIA GPUs 0300 (VGA). Discovery -> (PCI vendor, classes).
NFD_PCI = {"sysfs": ("1da3", ("1200",)), "nvml": ("10de", ("0302", "0300"))}
DRA_VENDOR = {"sysfs": "gaudi", "nvml": "nvidia"}  # --discovery -> kubetune.contracts.dra.VENDORS key


def nfd_pci_label(device_label: str) -> str:
    return f"feature.node.kubernetes.io/pci-{device_label}.present"


IMAGE = f"ghcr.io/kubetune/kubetune:{__version__}"  # the components' image: this release's


@dataclass(frozen=True)
class ComponentSettings:
    """What `render-components` renders: each field with a flag declares it here once
    (`kubetune.flags.with_options` makes the command's options from them)."""

    namespace: str = setting("kubetune-system", "--namespace", "", short="-n")
    image: str = setting(IMAGE, "--image", "")
    resource: str = setting(
        dra.VENDORS["gaudi"].extended_resource, "--resource", "Resource the device plugin advertises."
    )
    discovery: str = setting("sysfs", "--discovery", "sysfs | nvml")
    # node label the plugin copies into kubetune.io/network-leaf
    leaf_label: str | None = setting(
        None, "--leaf-label", "Node label holding the network leaf (copied by the plugin)."
    )
    extender_port: int = setting(EXTENDER_PORT, "--extender-port", "")
    extender_weight: int = setting(
        5, "--extender-weight", "KubeSchedulerConfiguration weight of the extender (1..100)."
    )
    weights: str = setting(  # "" = the extender's defaults
        "", "--weights", "Extender score weights, e.g. fit=3,hbm=1,closeness=5,rdma=1."
    )
    watch_pods: bool = setting(
        True, "--watch-pods/--stateless", "Extender with a pod cache (closeness score) or stateless."
    )
    metrics_port: int = 9400  # the device plugin's metrics (no flag: nothing else listens in its pod)
    node_selector: tuple[str, ...] = setting(  # instead of NFD's labels
        (),
        "--node-selector",
        "KEY=VALUE node label the device plugin's nodes need (repeatable); replaces the default, "
        "the Node Feature Discovery PCI labels of the vendor's cards.",
    )
    all_nodes: bool = setting(
        False, "--all-nodes", "Run the device plugin on every node (0 cards advertised where there are none)."
    )
    # the latency prober DaemonSet (what writes kubetune.io/rdma-latency-us)
    netprobe: bool = setting(
        True, "--netprobe/--no-netprobe", "Render the latency prober DaemonSet (kubetune netprobe)."
    )
    netprobe_port: int = setting(NETPROBE_PORT, "--netprobe-port", "TCP port the probers answer each other on.")
    # PodMonitor / ServiceMonitor for Prometheus (needs the Prometheus Operator's CRDs)
    monitors: bool = setting(
        True,
        "--monitors/--no-monitors",
        "Render a PodMonitor (device plugin) and a ServiceMonitor (extender); needs the Prometheus Operator.",
    )
    release: str = setting(
        DEFAULT_RELEASE,
        "--release",
        "The monitors' `release` label: the Helm release kube-prometheus-stack's Prometheus selects on.",
    )
    devices: str = setting(
        "plugin",
        "--devices",
        "plugin: the device plugin (extended resources); dra: the DRA driver and its DeviceClass (1.34+).",
    )
    kubernetes_version: str | None = setting(
        None, "--kubernetes-version", "The cluster's version, e.g. 1.33: --devices dra is refused before 1.34."
    )

    def __post_init__(self):
        problems = self._placement_problems() + self._devices_problems()
        if not 1 <= self.extender_weight <= 100:
            problems.append(
                f"--extender-weight {self.extender_weight}: use 1..100 (the scheduler multiplies the 0..10 score by it)"
            )
        if not 1 <= self.extender_port <= 65535:
            problems.append(f"--extender-port {self.extender_port}: not a TCP port")
        if not 1 <= self.netprobe_port <= 65535:
            problems.append(f"--netprobe-port {self.netprobe_port}: not a TCP port")
        if "/" not in self.resource:
            problems.append(
                f"--resource {self.resource!r}: an extended resource looks like vendor.com/name, e.g. habana.ai/gaudi"
            )
        if self.discovery.startswith("inventory:"):
            problems.append("--discovery inventory:FILE is for demos on one machine; a DaemonSet uses sysfs or nvml")
        elif self.discovery not in NFD_PCI:
            problems.append(f"--discovery {self.discovery!r}: use sysfs (Gaudi) or nvml (NVIDIA)")
        if problems:
            raise UserError(*problems)

    def _devices_problems(self) -> list[str]:
        if self.devices not in DEVICES:
            return [f"--devices {self.devices!r}: use plugin (the device plugin) or dra (the DRA driver, 1.34+)"]
        try:
            version = None
            if self.kubernetes_version is not None:
                version = dra.parse_version(self.kubernetes_version, "--kubernetes-version")
            if self.devices == "dra" and version is not None:
                dra.require_dra(version, "--devices dra")
        except UserError as e:
            return list(e.args)
        return []

    def _placement_problems(self) -> list[str]:
        problems = [
            f"--node-selector {item!r}: use KEY=VALUE, e.g. {nfd_pci_label('1200_1da3')}=true"
            for item in self.node_selector
            if not item.partition("=")[0].strip() or "=" not in item
        ]
        if self.node_selector and self.all_nodes:
            problems.append("--node-selector and --all-nodes exclude each other: pick the nodes or take them all")
        return problems


def _labels(name: str, component: str) -> dict[str, str]:
    return common_labels(name, component, part_of=KUBETUNE)


def _meta(name: str, s: ComponentSettings, component: str, namespaced: bool = True) -> dict:
    meta = {"name": name, "labels": _labels(name, component)}
    if namespaced:
        meta["namespace"] = s.namespace
    return meta


def _rbac(name: str, s: ComponentSettings, component: str, rules: list[dict]) -> list[dict]:
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(name, s, component)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": _meta(name, s, component, False),
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": _meta(name, s, component, False),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": s.namespace}],
        },
    ]


def plugin_placement(s: ComponentSettings) -> dict:
    """Pod spec fields that keep the plugin on accelerator nodes: NFD's PCI labels of the vendor
    (any one of its label forms), or the user's --node-selector; nothing with --all-nodes."""
    if s.all_nodes:
        return {}
    if s.node_selector:
        return {"nodeSelector": dict(item.split("=", 1) for item in s.node_selector)}
    vendor, classes = NFD_PCI[s.discovery]
    terms = [
        {"matchExpressions": [{"key": nfd_pci_label(label), "operator": "In", "values": ["true"]}]}
        for label in [f"{c}_{vendor}" for c in classes] + [vendor]
    ]  # nodeSelectorTerms are ORed: a node with any one of the labels qualifies
    return {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}
    }


def _plugin_env(s: ComponentSettings) -> list[dict]:
    env: list[dict] = [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    if s.discovery == "nvml":
        # As NVIDIA's plugin image sets them: the container toolkit then mounts libnvidia-ml
        # (utility) and every GPU into this container, which NVML needs to see the cards.
        env += [
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"},
        ]
    return env


def device_plugin(s: ComponentSettings) -> list[dict]:
    # not formatted: one flag and its value per line
    args = [
        "device-plugin",
        "--resource", s.resource,
        "--discovery", s.discovery,
        "--plugin-dir", str(DEFAULT_PLUGIN_DIR),
        "--publish-node-facts",
        "--metrics-port", str(s.metrics_port),
    ]  # fmt: skip
    if s.leaf_label:
        args += ["--leaf-label", s.leaf_label]
    selector = {NAME: PLUGIN_NAME}
    daemonset = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(PLUGIN_NAME, s, "device-plugin"),
        "spec": {
            "selector": {"matchLabels": selector},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": _labels(PLUGIN_NAME, "device-plugin")},
                "spec": {
                    **plugin_placement(s),
                    "serviceAccountName": PLUGIN_NAME,
                    "priorityClassName": "system-node-critical",
                    "tolerations": [
                        {"key": "CriticalAddonsOnly", "operator": "Exists"},
                        {"key": s.resource, "operator": "Exists", "effect": "NoSchedule"},
                    ],
                    "containers": [
                        {
                            "name": "device-plugin",
                            "image": s.image,
                            "command": list(POD_COMMAND),
                            "args": args,
                            "env": _plugin_env(s),
                            "ports": [{"name": METRICS_PORT_NAME, "containerPort": s.metrics_port, "protocol": "TCP"}],
                            "securityContext": {"privileged": True},
                            "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
                            "volumeMounts": [
                                {"name": "device-plugins", "mountPath": str(DEFAULT_PLUGIN_DIR)},
                                {"name": "pod-resources", "mountPath": POD_RESOURCES_DIR, "readOnly": True},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "device-plugins", "hostPath": {"path": str(DEFAULT_PLUGIN_DIR), "type": "Directory"}},
                        {"name": "pod-resources", "hostPath": {"path": POD_RESOURCES_DIR, "type": "Directory"}},
                    ],
                },
            },
        },
    }
    rules = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    return _rbac(PLUGIN_NAME, s, "device-plugin", rules) + [daemonset]


# What the driver's node plugin needs (KEP-4381): its slices, the claims it prepares, its Node (the owner).
DRA_RULES = [
    {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceslices"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    },
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
]


def device_class(vendor: dra.DraVendor) -> dict:
    """The vendor's DeviceClass: this driver's cards that are healthy now (the driver publishes
    `healthy` on every device, so the selector never reads a missing attribute)."""
    healthy = f'device.attributes["{vendor.driver}"].{dra.ATTR_HEALTHY}'
    return {
        "apiVersion": dra.RESOURCE_API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": vendor.device_class, "labels": _labels(DRA_DRIVER_NAME, "dra-driver")},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{vendor.driver}" && {healthy}'}}]},
    }


def _dra_volumes() -> tuple[list[dict], list[dict]]:
    """(volumeMounts, volumes): the kubelet's directories and the CDI dir at the host's paths, which
    the sockets' paths and the CDI ids the kubelet hands the runtime must equal."""
    dirs = [
        ("plugins-registry", DEFAULT_REGISTRY_DIR, "Directory"),
        ("plugins", DEFAULT_PLUGINS_DIR, "Directory"),
        ("cdi", DEFAULT_CDI_DIR, "DirectoryOrCreate"),
    ]
    mounts = [{"name": name, "mountPath": str(path)} for name, path, _ in dirs]
    volumes = [{"name": name, "hostPath": {"path": str(path), "type": kind}} for name, path, kind in dirs]
    return mounts, volumes


def dra_driver(s: ComponentSettings) -> list[dict]:
    vendor = dra.VENDORS[DRA_VENDOR[s.discovery]]
    # not formatted: one flag and its value per line
    args = [
        "dra-driver",
        "--discovery", s.discovery,
        "--registry-dir", str(DEFAULT_REGISTRY_DIR),
        "--plugins-dir", str(DEFAULT_PLUGINS_DIR),
        "--cdi-dir", str(DEFAULT_CDI_DIR),
    ]  # fmt: skip
    env = _plugin_env(s) + [{"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}]
    mounts, volumes = _dra_volumes()
    container = {
        "name": "dra-driver",
        "image": s.image,
        "command": list(POD_COMMAND),
        "args": args,
        "env": env,
        # root and privileged as the device plugin: the kubelet's directories are root's, and the
        # health probe looks at the host's device nodes
        "securityContext": {"privileged": True},
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "volumeMounts": mounts,
    }
    daemonset = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(DRA_DRIVER_NAME, s, "dra-driver"),
        "spec": {
            "selector": {"matchLabels": {NAME: DRA_DRIVER_NAME}},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": _labels(DRA_DRIVER_NAME, "dra-driver")},
                "spec": {
                    **plugin_placement(s),
                    "serviceAccountName": DRA_DRIVER_NAME,
                    "priorityClassName": "system-node-critical",
                    "tolerations": [
                        {"key": "CriticalAddonsOnly", "operator": "Exists"},
                        {"key": s.resource, "operator": "Exists", "effect": "NoSchedule"},
                    ],
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }
    return _rbac(DRA_DRIVER_NAME, s, "dra-driver", DRA_RULES) + [daemonset, device_class(vendor)]


def managed_resources(s: ComponentSettings) -> tuple[str, ...]:
    """What the extender scores and the scheduler sends it: the well-known cards, and the device
    plugin's resource when it is another (e.g. habana.ai/gaudi-mm), or its pods go unscored."""
    return tuple(dict.fromkeys((*keys.MANAGED_RESOURCES, s.resource)))


def extender(s: ComponentSettings) -> list[dict]:
    args = ["scheduler-extender", "--host", "0.0.0.0", "--port", str(s.extender_port)]
    if managed_resources(s) != keys.MANAGED_RESOURCES:  # the extender's own default otherwise
        args += [arg for resource in managed_resources(s) for arg in ("--resource", resource)]
    if s.weights:
        args += ["--weights", s.weights]
    if s.watch_pods:
        args.append("--watch-pods")
    selector = {NAME: EXTENDER_NAME}
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(EXTENDER_NAME, s, "scheduler-extender"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": _labels(EXTENDER_NAME, "scheduler-extender")},
                "spec": {
                    "serviceAccountName": EXTENDER_NAME,
                    "priorityClassName": "system-cluster-critical",
                    "containers": [
                        {
                            "name": "extender",
                            "image": s.image,
                            "command": list(POD_COMMAND),
                            "args": args,
                            "ports": [{"name": "http", "containerPort": s.extender_port, "protocol": "TCP"}],
                            "readinessProbe": probe,
                            "livenessProbe": dict(probe, initialDelaySeconds=5),
                            "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
                            "securityContext": {
                                "runAsNonRoot": True,
                                "runAsUser": 65532,
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                            },
                        }
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(EXTENDER_NAME, s, "scheduler-extender"),
        "spec": {
            "selector": selector,
            "ports": [{"name": "http", "port": s.extender_port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    objs = [deployment, service]
    if s.watch_pods:
        rules = [{"apiGroups": [""], "resources": ["pods", "nodes"], "verbs": ["get", "list", "watch"]}]
        objs = _rbac(EXTENDER_NAME, s, "scheduler-extender", rules) + objs
    else:
        objs = [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(EXTENDER_NAME, s, "scheduler-extender")}
        ] + objs
    return objs


def netprobe(s: ComponentSettings) -> list[dict]:
    """The latency prober: one pod per accelerator node, on the pod network (what the job's traffic crosses)."""
    component = "netprobe"
    args = ["netprobe", "--port", str(s.netprobe_port), "--selector", f"{NAME}={NETPROBE_NAME}"]
    field = [("NODE_NAME", "spec.nodeName"), ("POD_NAMESPACE", "metadata.namespace")]
    container = {
        "name": "netprobe",
        "image": s.image,
        "command": list(POD_COMMAND),
        "args": args,
        "env": [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": f}}} for n, f in field],
        "ports": [{"name": "probe", "containerPort": s.netprobe_port, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
        },
    }
    daemonset = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(NETPROBE_NAME, s, component),
        "spec": {
            "selector": {"matchLabels": {NAME: NETPROBE_NAME}},
            "template": {
                "metadata": {"labels": _labels(NETPROBE_NAME, component)},
                "spec": {
                    **plugin_placement(s),
                    "serviceAccountName": NETPROBE_NAME,
                    "tolerations": [{"key": s.resource, "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [container],
                },
            },
        },
    }
    nodes = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    return _rbac(NETPROBE_NAME, s, component, nodes) + _pod_reader(NETPROBE_NAME, s, component) + [daemonset]


def _pod_reader(name: str, s: ComponentSettings, component: str) -> list[dict]:
    """A Role to list the pods of its own namespace (the prober's peers), not the cluster's."""
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(name, s, component),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(name, s, component),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": s.namespace}],
        },
    ]


def component_monitors(s: ComponentSettings) -> list[dict]:
    """What Prometheus scrapes: each device-plugin pod (port `metrics`; the DRA driver serves no
    metrics), the extender's Service (`http`)."""
    plugin = monitors.pod_monitor(
        monitors.monitor_meta(PLUGIN_NAME, s.namespace, _labels(PLUGIN_NAME, "device-plugin"), s.release),
        {NAME: PLUGIN_NAME},
        [monitors.endpoint(METRICS_PORT_NAME, [monitors.node_relabeling()])],
    )
    extender = monitors.service_monitor(
        monitors.monitor_meta(EXTENDER_NAME, s.namespace, _labels(EXTENDER_NAME, "scheduler-extender"), s.release),
        {NAME: EXTENDER_NAME},
        [monitors.endpoint("http")],
    )
    return [plugin, extender] if s.devices == "plugin" else [extender]


def extender_url(s: ComponentSettings) -> str:
    return f"http://{EXTENDER_NAME}.{s.namespace}.svc:{s.extender_port}"


def scheduler_config(s: ComponentSettings) -> dict:
    """The KubeSchedulerConfiguration with kubetune's `extenders` entry (reference §7)."""
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        # Score every feasible node: with the adaptive default (~50% of a 256-node cluster)
        # a worker often never sees the leaf its job's other workers are on.
        "percentageOfNodesToScore": 100,
        "extenders": [
            {
                "urlPrefix": extender_url(s),
                "filterVerb": "filter",
                "prioritizeVerb": "prioritize",
                "weight": s.extender_weight,
                "enableHTTPS": False,
                "httpTimeout": "5s",
                # Names only when the extender watches the nodes itself: 5,000 full nodes are ~21 MB
                # a call, and with full nodes the scheduler takes the filter's returned objects as
                # its nodes (extender.go). --stateless can only judge the nodes it is sent.
                "nodeCacheCapable": s.watch_pods,
                **_managed_resources_entry(s),
                "ignorable": True,
            }
        ],
    }


def _managed_resources_entry(s: ComponentSettings) -> dict:
    """kube-scheduler calls the extender only for pods that request a listed extended resource, and
    for every pod when the list is absent. Pods that claim their cards through DRA request none,
    so with the DRA driver the list is left out (the extender is neutral on pods without cards)."""
    if s.devices == "dra":
        return {}
    return {"managedResources": [{"name": r, "ignoredByScheduler": False} for r in managed_resources(s)]}


def scheduler_config_map(s: ComponentSettings) -> dict:
    import yaml

    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(SCHEDULER_CONFIG_NAME, s, "scheduler-config"),
        "data": {"kube-scheduler-config.yaml": yaml.safe_dump(scheduler_config(s), sort_keys=False)},
    }


def render(s: ComponentSettings) -> list[dict]:
    node_side = device_plugin(s) if s.devices == "plugin" else dra_driver(s)
    objects = node_side + extender(s) + (netprobe(s) if s.netprobe else []) + [scheduler_config_map(s)]
    return objects + (component_monitors(s) if s.monitors else [])


def to_yaml(objects: list[dict]) -> str:
    import yaml

    return "---\n".join(yaml.safe_dump(o, sort_keys=False) for o in objects)
