"""From wire objects (v1.Pod, v1.Node) to the policy's inputs (Request, NodeFacts, Peers).

This is the only place that knows the annotation keys the device plugin publishes
(`kubetune.cluster.nodefacts`). Anything missing or malformed becomes None ("unknown").
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import NamedTuple, Protocol

from kubetune.cluster import nodefacts as keys
from kubetune.cluster.extender.policy import NodeFacts, Peers, Request
from kubetune.cluster.extender.protocol import Container, Node, Pod, Quantity, parse_count
from kubetune.contracts.kube import quantity_or_none

JOB_LABELS = (keys.KUBEFLOW_JOB_LABEL, keys.JOBSET_LABEL)


class PodView(Protocol):
    """What an optional pod cache answers (see `podcache.PodCache`)."""

    def used_cards(self, node: str, resource: str) -> int | None: ...

    def peers(self, namespace: str, job: str) -> Counter[str]:
        """Node name -> number of running pods of that job."""
        ...

    def leaf_of(self, node: str) -> str | None:
        """Network leaf of any node (peers often sit on nodes that are full, so not candidates)."""
        ...

    def raw_nodes(self, names: list[str]) -> list[RawNode | None]:
        """The cached node of each name (None: not known), for a scheduler that sends names only."""
        ...


def _container_cards(c: Container, resource: str) -> int:
    if c.resources is None:
        return 0
    for source in (c.resources.limits, c.resources.requests):  # extended resources: limits == requests
        if source and resource in source:
            return parse_count(source[resource]) or 0
    return 0


def pod_cards(pod: Pod, resource: str) -> int:
    """Effective request, as the scheduler counts it: max(sum of containers, largest init container)."""
    main = sum(_container_cards(c, resource) for c in pod.spec.containers)
    init = max((_container_cards(c, resource) for c in pod.spec.init_containers or []), default=0)
    return max(main, init)


def _gang_size(pod: Pod) -> int | None:
    """Workers in the job: the Kubeflow operator injects PET_NNODES (`N` or elastic `MIN:MAX`)."""
    for c in pod.spec.containers:
        for env in c.env or []:
            if env.name == "PET_NNODES" and env.value:
                n = parse_count(env.value.split(":")[-1])
                return n if n and n > 0 else None
    return None


def _job_of(pod: Pod) -> str | None:
    labels = pod.metadata.labels or {}
    job_name = next((labels[k] for k in JOB_LABELS if labels.get(k)), None)
    return f"{pod.metadata.namespace or 'default'}/{job_name}" if job_name else None


def request_of(pod: Pod, resources: tuple[str, ...]) -> Request:
    """What the pod asks for: whole cards of the first managed resource it requests, else, for a
    pod whose cards come from DRA claims (no extended resource to count), only its job."""
    job = _job_of(pod)
    gang_size = _gang_size(pod) if job else None
    for resource in resources:
        cards = pod_cards(pod, resource)
        if cards > 0:
            return Request(resource=resource, cards=cards, job=job, gang_size=gang_size)
    if pod.spec.resource_claims:
        return Request(resource=None, cards=0, job=job, gang_size=gang_size, claims=True)
    return Request(resource=None, cards=0)


_count = lru_cache(maxsize=4096)(parse_count)


@lru_cache(maxsize=4096)  # annotation values repeat across thousands of nodes
def _positive_float(text: str | None) -> float | None:
    if text is None:
        return None
    q: float | None
    try:
        q = float(text)  # the common case; "96Gi"-style quantities fall through to the parser
    except ValueError:
        q = quantity_or_none(text)
    return q if q is not None and 0 < q < float("inf") else None


class RawNode(NamedTuple):
    """The strings of one v1.Node that the policy reads, still unparsed (both decoders produce these)."""

    name: str
    leaf: str | None  # value of the first configured leaf label that is set
    allocatable: tuple[Quantity | None, ...]  # status.allocatable of each managed resource, in config order
    resource: str | None  # the plugin's annotations:
    cards_healthy: str | None
    cards_free: str | None
    hbm_per_card_mib: str | None
    rdma_latency_us: str | None
    hbm_free_mib: str | None


def raw_node(node: Node, resources: tuple[str, ...], leaf_labels: tuple[str, ...]) -> RawNode:
    """A pydantic-validated v1.Node -> RawNode."""
    labels = node.metadata.labels or {}
    ann = node.metadata.annotations or {}
    alloc = node.status.allocatable or {}
    return RawNode(
        node.metadata.name,
        next((labels[k] for k in leaf_labels if labels.get(k)), None),
        tuple(alloc.get(r) for r in resources),
        ann.get(keys.RESOURCE),
        ann.get(keys.CARDS_HEALTHY),
        ann.get(keys.CARDS_FREE),
        ann.get(keys.HBM_PER_CARD_MIB),
        ann.get(keys.RDMA_LATENCY_US),
        ann.get(keys.HBM_FREE_MIB),
    )


@lru_cache(maxsize=4096)
def _free_list(text: str | None) -> tuple[float, ...] | None:
    """`131072,98304` -> (131072.0, 98304.0), largest first; "" -> (); anything malformed -> None."""
    if text is None:
        return None
    try:
        values = [float(v) for v in text.split(",")] if text.strip() else []
    except ValueError:
        return None
    if not all(0 <= v < float("inf") for v in values):
        return None
    return tuple(sorted(values, reverse=True))


def _free_hbm(raw: RawNode, free: int | None) -> tuple[float, ...] | None:
    """The free cards' free HBM. When the pod cache counts fewer free cards than the plugin
    published, some were taken since: which ones is unknown, so keep the smallest (the worst case)."""
    values = _free_list(raw.hbm_free_mib)
    if values is None or free is None or free >= len(values):
        return values
    return values[len(values) - free :] if free > 0 else ()


def facts_from(raw: RawNode, resource: str, resource_index: int, pods: PodView | None = None) -> NodeFacts:
    """RawNode -> NodeFacts for `resource` (= resources[resource_index]); runs once per node per call."""
    ours = raw.resource is None or raw.resource == resource  # annotations for another resource do not apply
    total = _count(raw.allocatable[resource_index])
    if total is None and ours:
        total = _count(raw.cards_healthy)
    free = None
    used = pods.used_cards(raw.name, resource) if pods is not None else None
    if used is not None and total is not None:
        free = max(0, total - used)
    elif ours:
        free = _count(raw.cards_free)
        if free is not None and total is not None:
            free = min(free, total)
    hbm = _positive_float(raw.hbm_per_card_mib) if ours else None
    hbm_free = _free_hbm(raw, free) if ours else None
    return NodeFacts(raw.name, total, free, hbm, raw.leaf, _positive_float(raw.rdma_latency_us), hbm_free)


def facts_of(node: Node, resource: str, leaf_labels: tuple[str, ...], pods: PodView | None = None) -> NodeFacts:
    """One v1.Node -> NodeFacts (the convenient form, for tests and the pod cache)."""
    return facts_from(raw_node(node, (resource,), leaf_labels), resource, 0, pods)


def peers_of(req: Request, nodes: list[NodeFacts], pods: PodView | None) -> Peers:
    """Where the job's pods already run (needs the pod cache; stateless mode knows no peers)."""
    if req.job is None or pods is None:
        return Peers()
    namespace, _, job = req.job.partition("/")
    per_node = pods.peers(namespace, job)
    leaf_of = {n.name: n.leaf for n in nodes}
    leaves: Counter[str] = Counter()
    for node_name, count in per_node.items():
        leaf = leaf_of.get(node_name)
        if leaf is None:
            leaf = pods.leaf_of(node_name)  # a peer on a node that is not a candidate now
        if leaf is not None:
            leaves[leaf] += count
    return Peers(nodes=Counter(per_node), leaves=leaves)
