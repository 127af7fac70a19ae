"""Accelerator profiles: what a worker pod needs on Xeon (cpu), Intel Gaudi or NVIDIA nodes.

Each function returns one part of the worker pod as a plain dict (`KubeObject`); `objects`
assembles them. Requests always equal limits, so every profile gets Guaranteed QoS (and,
with the static CPU manager policy, exclusive cores). Keys are in alphabetical order, the order
these parts have always been rendered in (the snapshots compare the YAML text).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal

from kubetune.contracts.kube import KubeObject, drop_none, parse_quantity
from kubetune.recipe.comm import comm_env
from kubetune.recipe.k8s import ACCELERATOR_RESOURCE, K8sSection
from kubetune.recipe.schema import Recipe

# The training process may use 95% of the pod's memory limit: the rest is headroom for the
# page cache of the checkpoint writes, allocator fragmentation and short spikes, so the
# process sees its own budget run out before the kernel's OOM killer ends the pod.
MEMORY_HEADROOM = Decimal("0.05")
# k8s.devices=dra: the name of the pod's claim (spec.resourceClaims) its container uses, and of
# the one request in it (kubetune.k8s.claims renders the template behind it).
CLAIM = "cards"


@dataclass(frozen=True)
class Profile:
    name: str
    accelerator_resource: str | None
    host_ipc: bool  # Gaudi: HCCL and the Habana runtime share memory between processes over host IPC
    capabilities_add: tuple[str, ...]  # Gaudi: SYS_NICE lets the runtime pin and prioritise its threads
    non_root: bool  # Intel's Gaudi images expect root for /dev/accel; CPU and CUDA do not
    # k8s.devices=dra: what a worker's cards share unless k8s.dra.align says. Gaudi: one board,
    # whose RoCE links join every card to every other (HCCL's scale-up within a node runs over
    # them); NVIDIA: nothing asked, since a GPU node's NVLink topology varies by system.
    dra_align: str = "none"


PROFILES = {
    "cpu": Profile("cpu", None, host_ipc=False, capabilities_add=(), non_root=True),
    "gaudi": Profile(
        "gaudi",
        ACCELERATOR_RESOURCE["gaudi"],
        host_ipc=True,
        capabilities_add=("SYS_NICE",),
        non_root=False,
        dra_align="link_domain",
    ),
    "nvidia": Profile("nvidia", ACCELERATOR_RESOURCE["nvidia"], host_ipc=False, capabilities_add=(), non_root=True),
}


def resource_list(k8s: K8sSection) -> dict[str, str]:
    """The worker's limits (= requests): cpu, memory, accelerators, hugepages. With
    k8s.devices=dra the cards come from the pod's ResourceClaim instead (`claims`)."""
    res = k8s.worker_resources()
    limits = {"cpu": str(res["cpu"]), "memory": str(res["memory"])}
    profile = PROFILES[k8s.profile]
    if profile.accelerator_resource and res["accelerators"] and k8s.devices == "plugin":
        limits[profile.accelerator_resource] = str(res["accelerators"])
    if res["hugepages_2mi"]:
        limits["hugepages-2Mi"] = str(res["hugepages_2mi"])
    return limits


def worker_resources(k8s: K8sSection, devices: Mapping[str, str] | None = None) -> KubeObject:
    """The pod's `resources`: `resource_list` plus `devices` (a training worker's RDMA devices)."""
    limits = {**resource_list(k8s), **(devices or {})}
    claimed = [{"name": CLAIM}] if k8s.devices == "dra" else None
    return drop_none({"claims": claimed, "limits": limits, "requests": dict(limits)})


def dra_align(k8s: K8sSection) -> str:
    """k8s.dra.align, else the profile's default."""
    return k8s.dra.align or PROFILES[k8s.profile].dra_align


def cpus_per_process(k8s: K8sSection) -> int:
    """Whole CPUs each training process may use (threads per process follow it)."""
    cpu = parse_quantity(k8s.worker_resources()["cpu"])
    return max(1, int((cpu / k8s.processes_per_pod()).to_integral_value(ROUND_FLOOR)))


def memory_budget_bytes(k8s: K8sSection) -> int:
    memory = parse_quantity(k8s.worker_resources()["memory"])
    return int((memory * (1 - MEMORY_HEADROOM)).to_integral_value(ROUND_FLOOR))


def comm_environment(recipe: Recipe) -> dict[str, str]:
    """The `comm` section rendered for this profile, threads sized to the CPU limit."""
    k8s = recipe.k8s
    return comm_env(recipe.comm, k8s.profile, cpus_per_process(k8s), k8s.processes_per_pod())


def pod_security(k8s: K8sSection) -> KubeObject | None:
    if not PROFILES[k8s.profile].non_root:
        return None
    uid = k8s.run_as_user
    # fsGroup makes the shared volume writable for the non-root user on most provisioners.
    return {
        "fsGroup": uid,
        "runAsGroup": uid,
        "runAsNonRoot": True,
        "runAsUser": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security(k8s: K8sSection, extra_capabilities: tuple[str, ...] = ()) -> KubeObject:
    """The container's securityContext; `extra_capabilities`: a training worker's (`needs_ipc_lock`)."""
    profile = PROFILES[k8s.profile]
    add = [*profile.capabilities_add, *extra_capabilities]
    if profile.non_root:
        return {"allowPrivilegeEscalation": False, "capabilities": drop_none({"add": add or None, "drop": ["ALL"]})}
    return {"capabilities": {"add": add}}


def node_affinity(k8s: K8sSection) -> KubeObject | None:
    """cpu: require AMX-capable nodes (bf16 matmuls on AMX tiles), by the configured label."""
    if k8s.profile != "cpu" or not k8s.amx_label:
        return None
    term = {"matchExpressions": [{"key": k8s.amx_label, "operator": "In", "values": ["true"]}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def tolerations(k8s: K8sSection) -> list[KubeObject] | None:
    """The recipe's tolerations plus the accelerator taint that Gaudi/GPU node pools often carry."""
    out = [
        drop_none({"effect": t.effect, "key": t.key, "operator": t.operator, "value": t.value}) for t in k8s.tolerations
    ]
    resource = PROFILES[k8s.profile].accelerator_resource
    if resource and not any(t.key == resource for t in k8s.tolerations):
        out.append({"effect": "NoSchedule", "key": resource, "operator": "Exists"})
    return out or None


# ------------------------------------------------------------------------ scale-out networking
# What a worker pod needs to reach the other nodes, from comm.hccl.scale_out and k8s.network
# (docs/comm.md, "Scale-out between nodes"). Training workers only: serving and export pods
# talk over the pod network.

MULTUS_NETWORKS = "k8s.v1.cni.cncf.io/networks"  # Multus's annotation (github.com/k8snetworkplumbingwg/multus-cni)


def needs_ipc_lock(recipe: Recipe) -> bool:
    """RDMA registers (pins) the buffers it sends from: beyond RLIMIT_MEMLOCK, which a pod cannot
    raise (Kubernetes has no ulimit field), only CAP_IPC_LOCK lets a process lock more memory
    (capabilities(7)). Needed with an RDMA device, or host NICs over libfabric's verbs / efa."""
    hccl = recipe.comm.hccl
    ofi_rdma = hccl.scale_out == "host_nic_ofi" and (hccl.ofi_provider or "verbs") != "tcp"
    return recipe.k8s.network.rdma_resource is not None or (recipe.k8s.profile == "gaudi" and ofi_rdma)


def rdma_devices(recipe: Recipe) -> dict[str, str]:
    """The RDMA devices a worker requests (k8s.network.rdma_resource), beside its cards."""
    net = recipe.k8s.network
    return {net.rdma_resource: str(net.rdma_per_pod)} if net.rdma_resource else {}


def scale_out_capabilities(recipe: Recipe) -> tuple[str, ...]:
    return ("IPC_LOCK",) if needs_ipc_lock(recipe) else ()


def dns_policy(recipe: Recipe) -> str | None:
    # with hostNetwork the pod would resolve with the node's DNS: no cluster names, no rendezvous
    # service (kubernetes.io/docs/concepts/services-networking/dns-pod-service/, "Pod's DNS Policy")
    return "ClusterFirstWithHostNet" if recipe.k8s.network.host_network else None


def network_annotations(recipe: Recipe) -> dict[str, str]:
    """Multus's extra interfaces (k8s.network.networks)."""
    networks = recipe.k8s.network.networks
    return {MULTUS_NETWORKS: networks} if networks else {}


def worker_node_selector(recipe: Recipe) -> dict[str, str] | None:
    """k8s.node_selector, plus the scale-out label where the workers talk over their Gaudi NICs."""
    k8s, net = recipe.k8s, recipe.k8s.network
    # The Gaudi NICs' RoCE runs on the card, fed through its queues like its compute engines (the
    # habanalabs driver's NIC patches, netdev 2020): the habana.ai/gaudi devices are all a pod needs,
    # on a node whose scale-out ports are up.
    gaudi_nics = k8s.profile == "gaudi" and recipe.comm.hccl.scale_out == "gaudi_nics"
    if gaudi_nics and net.scale_out_label and k8s.elastic_range()[1] > 1:  # one node: no scale-out
        return {**k8s.node_selector, net.scale_out_label: "true"}
    return dict(k8s.node_selector) or None


def scale_out_warnings(recipe: Recipe) -> list[str]:
    """Host NICs over libfabric's RDMA providers need an RDMA device in the pod."""
    hccl, net = recipe.comm.hccl, recipe.k8s.network
    provider = hccl.ofi_provider or "verbs"
    if recipe.k8s.profile != "gaudi" or hccl.scale_out != "host_nic_ofi" or provider == "tcp" or net.rdma_resource:
        return []
    line = (
        f"comm.hccl.scale_out=host_nic_ofi with FI_PROVIDER={provider}, but the workers request no RDMA device: "
        "set k8s.network.rdma_resource (your RDMA device plugin's resource, e.g. rdma/roce), or "
        "comm.hccl.ofi_provider=tcp for host NICs without RDMA"
    )
    return [line]
