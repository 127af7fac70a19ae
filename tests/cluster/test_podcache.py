"""The extender's pod cache: its state machine, and list + watch against kmock's API server over HTTP."""

from __future__ import annotations

import pytest

from kubetune.cluster.deviceplugin.server import wait_for
from kubetune.cluster.extender.podcache import PodCache

from .samples import training_pod

LEAF = "kubetune.io/network-leaf"


def _cache() -> PodCache:
    return PodCache(("habana.ai/gaudi", "nvidia.com/gpu"), (LEAF,))


def test_cache_counts_bound_unfinished_pods_only():
    c = _cache()
    assert c.used_cards("n1", "habana.ai/gaudi") is None  # not synced yet: unknown
    c.replace(
        "pods",
        [
            training_pod("j", 0, cards=4, node_name="n1", phase="Running"),
            training_pod("j", 1, cards=2, node_name="n1", phase="Pending"),
        ],
    )
    c.apply_pod("ADDED", training_pod("j", 2, cards=8))  # not bound: holds nothing
    c.apply_pod("ADDED", training_pod("k", 0, cards=8, node_name="n2", phase="Succeeded"))  # finished
    assert c.used_cards("n1", "habana.ai/gaudi") == 6 and c.used_cards("n2", "habana.ai/gaudi") == 0
    assert c.used_cards("n1", "nvidia.com/gpu") == 0
    assert dict(c.peers("kubetune", "j")) == {"n1": 2} and not c.peers("other-ns", "j")
    c.apply_pod("MODIFIED", training_pod("j", 0, cards=4, node_name="n1", phase="Failed"))
    c.apply_pod("DELETED", training_pod("j", 1, cards=2, node_name="n1"))
    assert c.used_cards("n1", "habana.ai/gaudi") == 0
    c.apply_node("ADDED", {"metadata": {"name": "n1", "labels": {LEAF: "leaf-4"}}})
    assert c.leaf_of("n1") == "leaf-4" and c.leaf_of("n9") is None
    c.replace("pods", [])
    assert not c.peers("kubetune", "j")


def test_cache_lists_and_follows_a_real_api_server():
    pytest.importorskip("kmock")
    from tests.kit.kube import KmockServer

    server = KmockServer()
    cache = _cache()
    try:
        kube = server.client()
        kube.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": {LEAF: "leaf-1"}}})
        kube.create(training_pod("j", 0, cards=8, node_name="n1", phase="Running"))
        cache.start(kube, relist_seconds=0.2)
        assert cache.synced.wait(10)
        assert wait_for(lambda: cache.leaf_of("n1") == "leaf-1", 10)
        assert cache.used_cards("n1", "habana.ai/gaudi") == 8 and dict(cache.peers("kubetune", "j")) == {"n1": 1}
        # a pod appearing later is seen (by the watch, or by the next list if the watch fails)
        kube.create(training_pod("j", 2, cards=4, node_name="n1", phase="Running"))
        assert wait_for(lambda: cache.used_cards("n1", "habana.ai/gaudi") == 12, 10)
        kube.delete("v1", "Pod", "j-master-0", "kubetune")
        assert wait_for(lambda: cache.used_cards("n1", "habana.ai/gaudi") == 4, 10)
    finally:
        cache.stop()
        server.stop()
