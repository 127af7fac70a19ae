"""Placement policy of the scheduler extender (pure: no HTTP, no Kubernetes client).

Filter: a node stays only if the pod's whole-card request fits on it now.

A pod that claims its cards through DRA (Kubernetes 1.34+: spec.resourceClaims, no extended
resource) asks the extender for no cards: the filter keeps every node (the scheduler's own DRA
allocator decides which node's free devices satisfy the claim, and which cards, on which PCIe
root, healthy or not), and of the scores below only `closeness` and `rdma` apply; `fit` and
`hbm` are neutral, because the claim's cards are not what the device plugin's annotations count.

Prioritize: four component scores, each 0..10, combined as a weighted mean and rounded:

- `fit` rewards whole-card bin packing (the node the request leaves least fragmented):
  `10 * (1 - left/total)`, `left` = free cards after placing; a node filled exactly
  scores 10, an empty 8-card node given 1 card 1.25. Neutral (5): free or total cards unknown.
- `hbm` rewards free memory on the cards the pod can get: `10 * hbm / max hbm of the
  candidates`, `hbm` = the free HBM of the node's k-th freest free card (k = cards asked
  for; the plugin publishes each free card's free HBM, trimmed to the pod cache's free count),
  0 when fewer than k cards are free; else the per-card size. Neutral: neither is known.
- `closeness` rewards workers of one job on one node / one network leaf: a peer on this
  node: 10; else `9 * share of placed peers in this node's leaf`; first worker of a gang:
  `10 * min(1, free cards in the leaf / cards the gang still needs)`. Neutral: no job
  label, no leaf label, or (first worker) no gang size.
- `rdma` rewards low RDMA latency: `10 * min latency of the candidates / this node's
  latency`. Neutral: no latency annotation.

A component that is equal on every candidate node (e.g. no node has an RDMA annotation)
cannot change the order and is left out of the mean for that request, so the coarse 0..10
range goes to the components that tell the nodes apart.

The scheduler multiplies the final 0..10 by the extender's `weight` (and by 10) and adds it
to its own plugin scores, so the weight in KubeSchedulerConfiguration decides how much this
policy outweighs the default spreading.

Missing or malformed node data never raises: that component becomes neutral for that node.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import NamedTuple

from kubetune.errors import UserError

NEUTRAL = 5.0


@dataclass(frozen=True)
class Weights:
    """Relative weight of each component in the prioritize score (any non-negative numbers)."""

    fit: float = 3.0
    hbm: float = 1.0
    closeness: float = 5.0
    rdma: float = 1.0

    def __post_init__(self) -> None:
        bad = [f"`{f.name}`={getattr(self, f.name)!r}" for f in fields(self) if not (getattr(self, f.name) >= 0)]
        if bad:
            raise UserError(f"--weights: {', '.join(bad)} must be >= 0")
        if sum(getattr(self, f.name) for f in fields(self)) <= 0:
            raise UserError("--weights: at least one weight must be > 0, e.g. fit=3,hbm=1,closeness=5,rdma=1")

    @classmethod
    def parse(cls, text: str) -> Weights:
        """`fit=3,hbm=1,closeness=5,rdma=1` (any subset; the rest keep their defaults)."""
        names = {f.name for f in fields(cls)}
        values, problems = {}, []
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, raw = part.partition("=")
            key = key.strip()
            if key not in names:
                problems.append(f"--weights: unknown component `{key}`; use {', '.join(sorted(names))}")
                continue
            try:
                values[key] = float(raw)
            except ValueError:
                problems.append(f"--weights: `{key}` needs a number, got {raw!r}")
        if problems:
            raise UserError(*problems)
        return cls(**values)


@dataclass(frozen=True)
class Request:
    """What the pod asks for: `cards` whole cards of `resource` on one node, or (`claims`) cards
    through DRA ResourceClaims, whose number and choice the scheduler's DRA allocator decides."""

    resource: str | None
    cards: int
    job: str | None = None  # "namespace/job-name" when the pod belongs to a training job
    gang_size: int | None = None  # workers in the job (PET_NNODES), when known
    claims: bool = False  # the pod claims its cards through DRA (spec.resourceClaims)


class NodeFacts(NamedTuple):
    """What the policy knows about one node; None = unknown. (A tuple: thousands per request.)"""

    name: str
    cards_total: int | None = None  # healthy cards the kubelet can hand out (allocatable)
    cards_free: int | None = None
    hbm_per_card_mib: float | None = None
    leaf: str | None = None
    rdma_latency_us: float | None = None
    hbm_free_mib: tuple[float, ...] | None = None  # free HBM of each free card, largest first


@dataclass
class Peers:
    """Where the job's other workers already run: pods per node and per leaf."""

    nodes: Counter[str] = field(default_factory=Counter)
    leaves: Counter[str] = field(default_factory=Counter)

    @property
    def count(self) -> int:
        return sum(self.nodes.values())


def filter_nodes(req: Request, nodes: list[NodeFacts]) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """-> (names kept, failed {name: reason}, failed-and-unresolvable {name: reason}).

    Unresolvable: the node has fewer cards in total than the pod asks for, so preempting
    other pods cannot help. Unknown free count: the scheduler's own resource accounting has
    already passed the node, so it stays.
    """
    kept: list[str] = []
    failed: dict[str, str] = {}
    unresolvable: dict[str, str] = {}
    if req.cards <= 0 or req.resource is None:
        return [n.name for n in nodes], failed, unresolvable
    for n in nodes:
        if n.cards_total is None or n.cards_total == 0:
            unresolvable[n.name] = f"node offers no healthy {req.resource}"
        elif n.cards_total < req.cards:
            unresolvable[n.name] = (
                f"node has {n.cards_total} healthy {req.resource} in total; the pod needs {req.cards} on one node"
            )
        elif n.cards_free is not None and n.cards_free < req.cards:
            failed[n.name] = f"{n.cards_free} of {n.cards_total} {req.resource} free; the pod needs {req.cards}"
        else:
            kept.append(n.name)
    return kept, failed, unresolvable


def fit_score(req: Request, n: NodeFacts) -> float:
    if n.cards_free is None or not n.cards_total:
        return NEUTRAL
    left = n.cards_free - req.cards
    if left < 0:
        return 0.0
    return 10.0 * (1.0 - min(left, n.cards_total) / n.cards_total)


def hbm_available(req: Request, n: NodeFacts) -> float | None:
    """Free HBM every card of the pod can have on this node (MiB): the k-th freest free card's
    (k = cards asked for; 0 when fewer are free), else the card size; None when unknown."""
    if n.hbm_free_mib is not None and req.cards > 0:
        return n.hbm_free_mib[req.cards - 1] if len(n.hbm_free_mib) >= req.cards else 0.0
    if n.hbm_per_card_mib is None or not n.hbm_per_card_mib > 0:
        return None
    return n.hbm_per_card_mib


def hbm_score(hbm: float | None, best_hbm: float | None) -> float:
    if hbm is None or not best_hbm:
        return NEUTRAL
    return 10.0 * max(hbm, 0.0) / best_hbm


def closeness_score(req: Request, n: NodeFacts, peers: Peers, leaf_free: dict[str, int]) -> float:
    if req.job is None:
        return NEUTRAL
    if peers.count:
        if peers.nodes.get(n.name):
            return 10.0
        if n.leaf is None:
            return NEUTRAL
        return 9.0 * peers.leaves.get(n.leaf, 0) / peers.count
    # First worker of the gang: prefer a leaf with room for all of it.
    if n.leaf is None or not req.gang_size or n.leaf not in leaf_free:
        return NEUTRAL
    need = req.gang_size * req.cards
    return 10.0 * min(1.0, leaf_free[n.leaf] / need)


def rdma_score(n: NodeFacts, best_latency: float | None) -> float:
    if n.rdma_latency_us is None or n.rdma_latency_us <= 0 or not best_latency:
        return NEUTRAL
    return 10.0 * best_latency / n.rdma_latency_us


@dataclass(frozen=True)
class Breakdown:
    fit: float
    hbm: float
    closeness: float
    rdma: float
    total: int


def _clamp(x: float) -> float:
    return 0.0 if x != x else (0.0 if x < 0.0 else (10.0 if x > 10.0 else x))  # NaN -> 0


def _columns(req: Request, nodes: list[NodeFacts], peers: Peers) -> list[list[float]]:
    """The four component scores of every node, each 0..10: [fit, hbm, closeness, rdma]."""
    hbm = [hbm_available(req, n) for n in nodes]
    hbms = [h for h in hbm if h is not None and h > 0]
    lats = [n.rdma_latency_us for n in nodes if n.rdma_latency_us and n.rdma_latency_us > 0]
    best_hbm, best_lat = (max(hbms) if hbms else None), (min(lats) if lats else None)
    leaf_free: dict[str, int] = {}
    if req.job is not None and not peers.count and req.gang_size and req.cards > 0:
        for n in nodes:
            if n.leaf is not None and n.cards_free is not None and n.cards_free > 0:
                # only whole workers count: a node with 3 free cards holds one 2-card worker
                leaf_free[n.leaf] = leaf_free.get(n.leaf, 0) + (n.cards_free // req.cards) * req.cards
    neutral = [NEUTRAL] * len(nodes)  # components without data for anyone cost nothing per node
    cards_known = not req.claims  # a claim's cards are DRA's to count and choose, not these annotations'
    return [
        [fit_score(req, n) for n in nodes] if cards_known else neutral,  # 0..10 by construction
        [_clamp(hbm_score(h, best_hbm)) for h in hbm] if best_hbm and cards_known else neutral,
        [closeness_score(req, n, peers, leaf_free) for n in nodes]
        if req.job is not None
        else neutral,  # 0..10 by construction
        [_clamp(rdma_score(n, best_lat)) for n in nodes] if best_lat else neutral,
    ]


def _combine(columns: list[list[float]], weights: Weights) -> list[int]:
    w = [weights.fit, weights.hbm, weights.closeness, weights.rdma]
    # A component equal on every node cannot change the order; leaving it out of the mean
    # spends the scheduler's coarse 0..10 range on the components that tell nodes apart.
    informative = [wi if len(set(col)) > 1 else 0.0 for wi, col in zip(w, columns)]
    if sum(informative) > 0:
        w = informative
    wsum = sum(w)
    w0, w1, w2, w3 = (wi / wsum for wi in w)
    floor = math.floor
    return [int(_clamp(floor(w0 * a + w1 * b + w2 * c + w3 * d + 0.5))) for a, b, c, d in zip(*columns)]


def explain(
    req: Request, nodes: list[NodeFacts], peers: Peers | None = None, weights: Weights = Weights()
) -> dict[str, Breakdown]:
    """Every component per node, and the combined 0..10 integer the scheduler gets."""
    columns = _columns(req, nodes, peers or Peers())
    totals = _combine(columns, weights)
    fit, hbm, closeness, rdma = columns
    return {
        n.name: Breakdown(f, h, c, r, total=t) for n, t, f, h, c, r in zip(nodes, totals, fit, hbm, closeness, rdma)
    }


def prioritize(
    req: Request, nodes: list[NodeFacts], peers: Peers | None = None, weights: Weights = Weights()
) -> dict[str, int]:
    """Node name -> score 0..10 (see the table in the module docstring)."""
    if (req.cards <= 0 or req.resource is None) and not req.claims:
        return {n.name: int(NEUTRAL) for n in nodes}
    return dict(zip((n.name for n in nodes), _combine(_columns(req, nodes, peers or Peers()), weights)))
