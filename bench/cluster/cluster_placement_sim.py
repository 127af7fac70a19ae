"""Placement simulation: kube-scheduler's default spreading vs. the kubetune extender's scores.

    .venv/bin/python bench/cluster/cluster_placement_sim.py             # the figures in bench/results/cluster.md
    .venv/bin/python bench/cluster/cluster_placement_sim.py --jobs 400  # a quicker run

Cluster: 256 Gaudi nodes x 8 cards, 16 nodes per network leaf (16 leaves). A Poisson
stream of training jobs arrives; each is a gang of 2-16 workers with 1, 2, 4 or 8 cards
each, and runs for an exponential time. A gang is placed all-or-nothing (as Kueue or the
Coscheduling plugin do); a job that does not fit when it arrives is counted as not placed.

The scheduler is modelled the way kube-scheduler works, one pod at a time:
- it looks for feasible nodes from a rotating start index and stops after
  `percentageOfNodesToScore` of them (adaptive default: 50% - nodes/125, at least 100 nodes;
  the KubeSchedulerConfiguration kubetune renders sets 100, so the extender sees every
  feasible node: with the default, a worker often never sees its job's leaf);
- `default`: NodeResourcesFit LeastAllocated (free share x 100; cpu and memory requests
  scale with cards, so this is the card share), ties broken at random;
- `kubetune`: the same, plus the extender: its /filter and then its /prioritize score
  x weight (5) x 10, computed by the real policy code (`kubetune.cluster.extender.policy`)
  with the pod cache's view of where the job's workers already run;
- `stateless`: the extender without the pod cache (no closeness: fit, HBM, RDMA only).

Reported per policy: jobs placed, cross-leaf worker pairs (pairs of one job's workers on
different leaves; ring/tree all-reduce traffic crosses the spine for each), in total and over
the jobs both policies placed, which is the comparison at equal jobs placed, stranded free
cards (the share of free cards on partly used nodes, averaged over arrivals) and whole free
nodes (averaged), and the ratios against the default.
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from kubetune.cluster.extender import policy
from kubetune.cluster.extender.policy import NodeFacts, Peers, Request, Weights

RESOURCE = "habana.ai/gaudi"
HBM_MIB = 128 * 1024


@dataclass
class Job:
    id: int
    arrival: float
    duration: float
    workers: int
    cards: int


@dataclass
class Cluster:
    nodes: int = 256
    cards: int = 8
    per_leaf: int = 16
    percentage_to_score: int = 0  # 0 = kube-scheduler's adaptive default
    free: list[int] = field(default_factory=list)
    next_start: int = 0

    def __post_init__(self):
        self.free = [self.cards] * self.nodes

    def leaf(self, node: int) -> int:
        return node // self.per_leaf

    def nodes_to_find(self) -> int:
        """kube-scheduler's numFeasibleNodesToFind for percentageOfNodesToScore."""
        if self.nodes < 100 or self.percentage_to_score >= 100:
            return self.nodes
        pct = self.percentage_to_score or max(5, 50 - self.nodes // 125)  # the adaptive default
        return max(100, self.nodes * pct // 100)

    def feasible(self, cards: int) -> list[int]:
        want, found, processed = self.nodes_to_find(), [], 0
        for k in range(self.nodes):
            node = (self.next_start + k) % self.nodes
            processed += 1
            if self.free[node] >= cards:
                found.append(node)
                if len(found) >= want:
                    break
        self.next_start = (self.next_start + processed) % self.nodes
        return found


def job_stream(n: int, load: float, seed: int, cluster_cards: int) -> list[Job]:
    rng = random.Random(seed)
    sizes, weights = [1, 2, 4, 8], [0.15, 0.2, 0.25, 0.4]
    mean_cards = sum(s * w for s, w in zip(sizes, weights)) * 9  # workers uniform 2..16: mean 9
    rate = load * cluster_cards / mean_cards  # arrivals per unit time, mean duration 1
    jobs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        jobs.append(Job(i, t, rng.expovariate(1.0), rng.randint(2, 16), rng.choices(sizes, weights)[0]))
    return jobs


class Placer:
    """One scheduling policy: picks a node for one worker, or None."""

    def __init__(
        self, name: str, cluster: Cluster, seed: int, extender_weight: int = 5, weights: Weights | None = None
    ):
        self.name = name
        self.cluster = cluster
        self.rng = random.Random(seed)
        self.extender_weight = extender_weight
        self.weights = weights if weights is not None else Weights()

    def least_allocated(self, node: int) -> int:
        return self.cluster.free[node] * 100 // self.cluster.cards

    def pick(self, job: Job, placed: list[int]) -> int | None:
        feasible = self.cluster.feasible(job.cards)
        if not feasible:
            return None
        scores = {n: self.least_allocated(n) for n in feasible}
        if self.name != "default":
            facts = [
                NodeFacts(
                    f"n{n}", self.cluster.cards, self.cluster.free[n], HBM_MIB, f"leaf-{self.cluster.leaf(n)}", None
                )
                for n in feasible
            ]
            req = Request(RESOURCE, job.cards, job=f"sim/job-{job.id}", gang_size=job.workers)
            kept, _, _ = policy.filter_nodes(req, facts)
            kept_set = set(kept)
            peers = Peers()
            if self.name == "kubetune":  # the pod cache: where this job's workers already are
                peers = Peers(Counter(f"n{n}" for n in placed), Counter(f"leaf-{self.cluster.leaf(n)}" for n in placed))
            ext = policy.prioritize(req, [f for f in facts if f.name in kept_set], peers, self.weights)
            scores = {n: s + ext[f"n{n}"] * self.extender_weight * 10 for n, s in scores.items() if f"n{n}" in kept_set}
            if not scores:
                return None
        best = max(scores.values())
        return self.rng.choice([n for n, s in scores.items() if s == best])  # kube-scheduler: random among the best


@dataclass
class Result:
    name: str
    placed: int = 0
    offered: int = 0
    cross_leaf_pairs: int = 0
    worker_pairs: int = 0
    cross_by_job: dict[int, int] = field(default_factory=dict)  # placed job id -> its cross-leaf pairs
    stranded: list[float] = field(default_factory=list)
    whole_free: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def stranded_mean(self) -> float:
        return sum(self.stranded) / max(1, len(self.stranded))

    @property
    def whole_free_mean(self) -> float:
        return sum(self.whole_free) / max(1, len(self.whole_free))


def simulate(name: str, jobs: list[Job], seed: int, weights: Weights, percentage_to_score: int) -> Result:
    cluster = Cluster(percentage_to_score=0 if name == "default" else percentage_to_score)
    placer = Placer(name, cluster, seed, weights=weights)
    result = Result(name, offered=len(jobs))
    running: list[tuple[float, int, list[int], int]] = []  # (end, job id, nodes, cards)
    start = time.perf_counter()
    for job in jobs:
        while running and running[0][0] <= job.arrival:
            _, _, nodes, cards = heapq.heappop(running)
            for n in nodes:
                cluster.free[n] += cards
        free_total = sum(cluster.free)
        whole = sum(1 for f in cluster.free if f == cluster.cards)
        result.stranded.append(1 - whole * cluster.cards / free_total if free_total else 0.0)
        result.whole_free.append(whole)
        placed: list[int] = []
        for _ in range(job.workers):
            node = placer.pick(job, placed)
            if node is None:
                break
            cluster.free[node] -= job.cards
            placed.append(node)
        if len(placed) < job.workers:  # all or nothing
            for n in placed:
                cluster.free[n] += job.cards
            continue
        result.placed += 1
        leaves = [cluster.leaf(n) for n in placed]
        pairs = len(leaves) * (len(leaves) - 1) // 2
        same = sum(c * (c - 1) // 2 for c in Counter(leaves).values())
        result.worker_pairs += pairs
        result.cross_leaf_pairs += pairs - same
        result.cross_by_job[job.id] = pairs - same
        heapq.heappush(running, (job.arrival + job.duration, job.id, placed, job.cards))
    result.seconds = time.perf_counter() - start
    return result


def report(load: float, results: list[Result]) -> None:
    base = results[0]
    print(f"\noffered load {load:.2f} of 2,048 cards, {base.offered} jobs (gangs of 2-16 workers x 1/2/4/8 cards)")
    print(
        f"{'policy':>10} {'placed':>7} {'x-leaf pairs':>13} {'pairs':>7} {'x-leaf/job':>11} {'x-leaf share':>13} "
        f"{'stranded free':>14} {'whole free nodes':>17} {'sim s':>6}"
    )
    for r in results:
        per_job = r.cross_leaf_pairs / max(1, r.placed)
        share = r.cross_leaf_pairs / max(1, r.worker_pairs)
        print(
            f"{r.name:>10} {r.placed:>7} {r.cross_leaf_pairs:>13} {r.worker_pairs:>7} {per_job:>11.2f} {share:>13.1%} "
            f"{r.stranded_mean:>14.1%} {r.whole_free_mean:>17.1f} {r.seconds:>6.1f}"
        )
    for r in results[1:]:
        # "At equal jobs placed": the jobs that both policies placed, pair counts side by side.
        common = base.cross_by_job.keys() & r.cross_by_job.keys()
        ours, theirs = sum(r.cross_by_job[j] for j in common), sum(base.cross_by_job[j] for j in common)
        ratio = ours / max(1, theirs)
        print(
            f"{r.name} vs default: jobs placed {r.placed} vs {base.placed} (x{r.placed / max(1, base.placed):.3f}); "
            f"on the {len(common)} jobs both placed, "
            f"cross-leaf pairs {ours} vs {theirs} (x{ratio:.3f}, {_fewer(ratio)}); "
            f"stranded free cards x{r.stranded_mean / max(1e-9, base.stranded_mean):.2f}; "
            f"whole free nodes x{r.whole_free_mean / max(1e-9, base.whole_free_mean):.2f}"
        )


def _fewer(ratio: float) -> str:
    return f"{1 - ratio:.1%} fewer" if ratio <= 1 else f"{ratio - 1:.1%} more"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1500)
    ap.add_argument("--loads", default="0.3,0.6,0.9", help="offered loads (share of all cards busy on average)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--weights", default="", help="extender --weights, e.g. fit=3,closeness=5")
    # not formatted: the option's name, type and default on one line
    ap.add_argument(
        "--percentage-to-score", type=int, default=100,
        help="percentageOfNodesToScore of the kubetune arms (render-components sets 100; 0 = adaptive default)",
    )  # fmt: skip
    args = ap.parse_args()
    weights = Weights.parse(args.weights) if args.weights else Weights()
    pct = args.percentage_to_score or "adaptive"
    print(
        f"extender weights: {weights}; extender weight 5; "
        f"percentageOfNodesToScore: default arm adaptive, kubetune arms {pct}"
    )
    for load in (float(x) for x in args.loads.split(",")):
        jobs = job_stream(args.jobs, load, args.seed, 256 * 8)
        results = [
            simulate(name, jobs, args.seed, weights, args.percentage_to_score)
            for name in ("default", "stateless", "kubetune")
        ]
        report(load, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
