"""Which cards to hand a container (pure: no gRPC, no I/O).

GetPreferredAllocation: always keep `must_include`, then stay on as few NUMA nodes as
possible, then take adjacent OAM modules, then leave the NUMA nodes that are still whole
untouched (best fit). Gaudi cards in a box are linked all-to-all, so adjacency is a
tie-breaker that keeps the `HABANA_VISIBLE_MODULES` ranges tidy, not a bandwidth claim;
NUMA locality is what costs host-to-device bandwidth.
"""

from __future__ import annotations

from itertools import combinations
from math import comb

from kubetune.cluster.devices.discovery import Card

# Above this many candidate sets the exact search gives way to a greedy choice.
EXACT_SEARCH_LIMIT = 20_000


def _cost(chosen: tuple[Card, ...], available_per_numa: dict[int | None, int]) -> tuple:
    numas = {c.numa_node for c in chosen}
    modules = sorted(c.module_id if c.module_id is not None else c.index for c in chosen)
    gaps = (modules[-1] - modules[0] + 1 - len(modules)) if modules else 0
    leftover_in_used_numas = sum(available_per_numa[n] for n in numas) - len(chosen)
    return (len(numas), gaps, leftover_in_used_numas, modules)


def preferred_allocation(available: list[Card], must_include: list[Card], size: int) -> list[Card]:
    """`size` cards from `available`, containing every card of `must_include`.

    Returns fewer than `size` only if `available` is too small (the kubelet then decides).
    """
    must_ids = {c.id for c in must_include}
    pool = [c for c in available if c.id not in must_ids]
    need = size - len(must_include)
    if need <= 0:
        return list(must_include)[: max(size, len(must_include))]
    if need >= len(pool):
        return list(must_include) + pool
    per_numa: dict[int | None, int] = {}
    for c in list(must_include) + pool:
        per_numa[c.numa_node] = per_numa.get(c.numa_node, 0) + 1
    if comb(len(pool), need) <= EXACT_SEARCH_LIMIT:
        best = min(combinations(pool, need), key=lambda extra: _cost(tuple(must_include) + extra, per_numa))
        return list(must_include) + list(best)
    return list(must_include) + _greedy(pool, must_include, need, per_numa)


def _greedy(pool: list[Card], must_include: list[Card], need: int, per_numa: dict[int | None, int]) -> list[Card]:
    """Large boxes: fill from the must_include NUMA nodes, then from the fullest NUMA node, by module."""
    must_numas = {c.numa_node for c in must_include}

    def key(c: Card):
        return (
            c.numa_node not in must_numas,
            -per_numa[c.numa_node],
            str(c.numa_node),
            c.module_id if c.module_id is not None else c.index,
        )

    return sorted(pool, key=key)[:need]
