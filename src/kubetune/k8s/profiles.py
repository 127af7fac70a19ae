"""Accelerator profiles: what a worker pod needs on Xeon (cpu), Intel Gaudi or NVIDIA nodes.

Each function returns kubernetes client models for one aspect of the worker pod; `render`
assembles them. Requests always equal limits, so every profile gets Guaranteed QoS (and,
with the static CPU manager policy, exclusive cores).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal
from typing import TYPE_CHECKING

from kubetune.contracts.kube import parse_quantity
from kubetune.recipe.comm import comm_env
from kubetune.recipe.k8s import ACCELERATOR_RESOURCE, K8sSection
from kubetune.recipe.schema import Recipe

if TYPE_CHECKING:  # the kubernetes client is untyped: these names document intent (they are Any to mypy)
    from kubernetes.client import (
        V1Affinity,
        V1ObjectMeta,
        V1PodSecurityContext,
        V1PodSpec,
        V1ResourceRequirements,
        V1SecurityContext,
        V1Toleration,
    )

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


def worker_resources(k8s: K8sSection) -> V1ResourceRequirements:
    from kubernetes.client import CoreV1ResourceClaim, V1ResourceRequirements

    limits = resource_list(k8s)
    claimed = [CoreV1ResourceClaim(name=CLAIM)] if k8s.devices == "dra" else None
    return V1ResourceRequirements(requests=dict(limits), limits=limits, claims=claimed)


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


def pod_security(k8s: K8sSection) -> V1PodSecurityContext | None:
    from kubernetes.client import V1PodSecurityContext, V1SeccompProfile

    if not PROFILES[k8s.profile].non_root:
        return None
    uid = k8s.run_as_user
    # fsGroup makes the shared volume writable for the non-root user on most provisioners.
    return V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=uid,
        run_as_group=uid,
        fs_group=uid,
        seccomp_profile=V1SeccompProfile(type="RuntimeDefault"),
    )


def container_security(k8s: K8sSection) -> V1SecurityContext:
    from kubernetes.client import V1Capabilities, V1SecurityContext

    profile = PROFILES[k8s.profile]
    if profile.non_root:
        return V1SecurityContext(allow_privilege_escalation=False, capabilities=V1Capabilities(drop=["ALL"]))
    return V1SecurityContext(capabilities=V1Capabilities(add=list(profile.capabilities_add)))


def node_affinity(k8s: K8sSection) -> V1Affinity | None:
    """cpu: require AMX-capable nodes (bf16 matmuls on AMX tiles), by the configured label."""
    from kubernetes.client import (
        V1Affinity,
        V1NodeAffinity,
        V1NodeSelector,
        V1NodeSelectorRequirement,
        V1NodeSelectorTerm,
    )

    if k8s.profile != "cpu" or not k8s.amx_label:
        return None
    term = V1NodeSelectorTerm(
        match_expressions=[V1NodeSelectorRequirement(key=k8s.amx_label, operator="In", values=["true"])]
    )
    return V1Affinity(
        node_affinity=V1NodeAffinity(
            required_during_scheduling_ignored_during_execution=V1NodeSelector(node_selector_terms=[term])
        )
    )


def tolerations(k8s: K8sSection) -> list[V1Toleration] | None:
    """The recipe's tolerations plus the accelerator taint that Gaudi/GPU node pools often carry."""
    from kubernetes.client import V1Toleration

    out = [V1Toleration(key=t.key, operator=t.operator, value=t.value, effect=t.effect) for t in k8s.tolerations]
    resource = PROFILES[k8s.profile].accelerator_resource
    if resource and not any(t.key == resource for t in k8s.tolerations):
        out.append(V1Toleration(key=resource, operator="Exists", effect="NoSchedule"))
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


def apply_scale_out(recipe: Recipe, spec: V1PodSpec, meta: V1ObjectMeta) -> None:
    """Add the scale-out settings to a worker pod built by `objects.worker_pod_template`."""
    net, container = recipe.k8s.network, spec.containers[0]
    if net.host_network:
        # with hostNetwork the pod would resolve with the node's DNS: no cluster names, no rendezvous
        # service (kubernetes.io/docs/concepts/services-networking/dns-pod-service/, "Pod's DNS Policy")
        spec.host_network, spec.dns_policy = True, "ClusterFirstWithHostNet"
    if net.rdma_resource:
        for quantities in (container.resources.limits, container.resources.requests):
            quantities[net.rdma_resource] = str(net.rdma_per_pod)
    if net.networks:
        meta.annotations = {**(meta.annotations or {}), MULTUS_NETWORKS: net.networks}
    if needs_ipc_lock(recipe):
        caps = container.security_context.capabilities
        caps.add = [*(caps.add or []), "IPC_LOCK"]
    # The Gaudi NICs' RoCE runs on the card, fed through its queues like its compute engines (the
    # habanalabs driver's NIC patches, netdev 2020): the habana.ai/gaudi devices are all a pod needs,
    # on a node whose scale-out ports are up.
    gaudi_nics = recipe.k8s.profile == "gaudi" and recipe.comm.hccl.scale_out == "gaudi_nics"
    if gaudi_nics and net.scale_out_label and recipe.k8s.elastic_range()[1] > 1:  # one node: no scale-out
        spec.node_selector = {**(spec.node_selector or {}), net.scale_out_label: "true"}


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
