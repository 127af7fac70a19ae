"""The extender as kube-scheduler calls it: Filter, then Prioritize on the nodes Filter handed back.

The client is a port of kube-scheduler's HTTPExtender (kube_scheduler.py), configured from the
`extenders:` entry `render-components` writes; the extender is the real app on a loopback port,
and in the watching configuration its cache lists and watches kmock's API server over HTTP.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("kmock")

from kubetune.cluster.deviceplugin.server import wait_for
from kubetune.cluster.extender.app import ExtenderConfig, create_app
from kubetune.cluster.extender.podcache import PodCache
from kubetune.cluster.extender.server import running
from kubetune.cluster.manifests import ComponentSettings, scheduler_config

from .kube_scheduler import HTTPExtender, node_name, schedule_one
from .samples import gaudi_node, training_pod

# Each case: the pod, the candidate nodes, the pairs (better, worse) the extender must tell
# apart, and the nodes its filter must remove. The nodes hold no pods (the cache counts none),
# so a node's free cards are its total: the answer is the same with and without the cache.
CASES = {
    "topology": (
        training_pod("gang", 0, cards=4, workers=2),  # the first of two 4-card workers
        [
            gaudi_node("a1", cards=4, free=4, leaf="leaf-a"),  # leaf-a holds the whole gang
            gaudi_node("a2", cards=4, free=4, leaf="leaf-a"),
            gaudi_node("b1", cards=4, free=4, leaf="leaf-b"),  # leaf-b holds half of it
            gaudi_node("small", cards=2, free=2, leaf="leaf-b"),  # too small for a worker
        ],
        [("a1", "b1"), ("a2", "b1")],
        {"small"},
    ),
    "free HBM": (
        training_pod("solo", 0, cards=4, workers=1),
        [
            gaudi_node("clean", cards=4, free=4, hbm_free=[131072] * 4),
            gaudi_node("leaky", cards=4, free=4, hbm_free=[131072, 131072, 131072, 20480]),  # one card mostly used
        ],
        [("clean", "leaky")],
        set(),
    ),
    "RDMA latency": (
        training_pod("solo", 0, cards=4, workers=1),
        [gaudi_node("near", rdma_latency_us=2.0), gaudi_node("far", rdma_latency_us=8.0)],
        [("near", "far")],
        set(),
    ),
}
ALL_NODES = [node for _, nodes, _, _ in CASES.values() for node in nodes]
CONFIG = ExtenderConfig()


@pytest.fixture(scope="module")
def watching_cache():
    """The extender's watch-backed cache, synced with an API server that holds every case's nodes."""
    from tests.kit.kube import KmockServer

    server = KmockServer(("v1/pods",))  # an empty pod list, not a 404
    cache = PodCache(CONFIG.resources, CONFIG.leaf_labels)
    try:
        kube = server.client()
        for node in ALL_NODES:
            kube.create(node)
        cache.start(kube, relist_seconds=0.2)
        assert cache.synced.wait(10)
        assert wait_for(lambda: all(cache.leaf_of(node_name(n)) for n in ALL_NODES), 10)
        yield cache
    finally:
        cache.stop()
        server.stop()


def _extender(watch_pods: bool, cache: PodCache, node_cache_capable: bool | None = None):
    """The app as `render-components` deploys it, and its `extenders:` entry as the scheduler reads it."""
    entry = scheduler_config(ComponentSettings(watch_pods=watch_pods))["extenders"][0]
    if node_cache_capable is not None:  # a hand-written configuration
        entry = {**entry, "nodeCacheCapable": node_cache_capable}
    return create_app(CONFIG, cache if watch_pods else None), entry


def _check_case(extender: HTTPExtender, case: str) -> None:
    pod, nodes, better, removed = CASES[case]
    cycle = schedule_one(extender, pod, nodes)
    feasible = {node_name(n): n for n in cycle.feasible}
    assert set(feasible) == {node_name(n) for n in nodes} - removed, case
    assert set(cycle.statuses) == removed, case
    scores = cycle.extender_scores
    for high, low in better:
        assert scores[high] > scores[low], f"{case}: {high} should outscore {low}, got {scores}"
    # The rest of the cycle works on the node objects Filter handed back: they must be the
    # scheduler's own, not a copy stripped of labels, annotations and allocatable.
    assert all(feasible[node_name(n)] == n for n in nodes if node_name(n) in feasible), case


@pytest.mark.parametrize("watch_pods", [True, False], ids=["watching", "stateless"])
@pytest.mark.parametrize("case", list(CASES))
def test_scores_reach_the_scheduler_through_filter_then_prioritize(watching_cache, watch_pods, case):
    app, entry = _extender(watch_pods, watching_cache)
    with running(app) as url:
        _check_case(HTTPExtender.from_config(entry, url_prefix=url), case)


@pytest.mark.parametrize("case", list(CASES))
def test_a_watching_extender_also_serves_a_scheduler_that_sends_full_nodes(watching_cache, case):
    """nodeCacheCapable: false in a hand-written configuration, with the pod cache running."""
    app, entry = _extender(True, watching_cache, node_cache_capable=False)
    with running(app) as url:
        _check_case(HTTPExtender.from_config(entry, url_prefix=url), case)


def test_rendered_mode_matches_what_the_extender_keeps():
    """nodeCacheCapable: true only where the extender watches nodes (it must know them by name)."""
    for watch_pods in (True, False):
        (entry,) = scheduler_config(ComponentSettings(watch_pods=watch_pods))["extenders"]
        assert entry["nodeCacheCapable"] is watch_pods


def test_a_node_the_cache_does_not_know_yet_is_kept_and_scored_neutral(watching_cache):
    """A node that joined after the last list: the scheduler knows it, the extender not yet."""
    app, entry = _extender(True, watching_cache)
    pod, nodes, _, _ = CASES["RDMA latency"]
    newcomer = gaudi_node("joined-a-moment-ago", rdma_latency_us=1.0)
    with running(app) as url:
        cycle = schedule_one(HTTPExtender.from_config(entry, url_prefix=url), pod, [*nodes, newcomer])
    assert [node_name(n) for n in cycle.feasible] == ["near", "far", "joined-a-moment-ago"]
    scores = cycle.extender_scores
    assert scores["joined-a-moment-ago"] == 5 * entry["weight"] * 10 and scores["near"] > scores["far"]
