"""Node facts: the pure mapping, the kubelet PodResources client (real gRPC), and the patch (kmock API server)."""

from __future__ import annotations

import pytest

from kubetune.cluster import nodefacts as keys
from kubetune.cluster.deviceplugin.publish import NodePublisher, PodResourcesClient, node_facts
from kubetune.cluster.devices.discovery import HEALTHY, UNHEALTHY
from kubetune.cluster.devices.gaudi import SysfsGaudiDiscovery
from kubetune.cluster.extender.facts import facts_of
from kubetune.cluster.extender.protocol import Node

from .fakes import FakePodResources, hls_box, make_gaudi_tree


@pytest.fixture
def cards(tmp_path):
    sysfs, dev = make_gaudi_tree(tmp_path / "node", hls_box("0x1020", 8))
    return SysfsGaudiDiscovery(sysfs_root=sysfs, dev_root=dev).devices()


def test_node_facts_counts_health_use_numa_and_hbm(cards):
    health = {c.id: HEALTHY for c in cards}
    health[cards[7].id] = UNHEALTHY
    annotations, labels = node_facts("habana.ai/gaudi", cards, health, {cards[0].id, cards[1].id}, "rack 12/leaf")
    assert annotations == {
        keys.RESOURCE: "habana.ai/gaudi",
        keys.CARDS_TOTAL: "8",
        keys.CARDS_HEALTHY: "7",
        keys.CARDS_FREE: "5",
        keys.HBM_FREE_MIB: ",".join([str(96 * 1024)] * 5),  # sysfs measures nothing: a free card's size
        keys.HBM_PER_CARD_MIB: str(96 * 1024),
        keys.NUMA_LAYOUT: "0:4/4,1:3/4",
    }
    assert labels == {keys.ACCELERATOR_LABEL: "gaudi2", keys.LEAF_LABEL: "rack-12-leaf"}
    unknown_use, _ = node_facts("habana.ai/gaudi", cards, health, None, None)
    assert keys.CARDS_FREE not in unknown_use and keys.HBM_FREE_MIB not in unknown_use  # never guess


def test_free_hbm_is_measured_memory_on_the_free_cards_only(cards):
    health = {c.id: HEALTHY for c in cards}
    health[cards[7].id] = UNHEALTHY
    # card 2: free, but something outside Kubernetes holds ~46 GiB of it; card 0: held by a pod
    measured = {cards[0].id: 1000, cards[2].id: 50_000}
    annotations, _ = node_facts("habana.ai/gaudi", cards, health, {cards[0].id}, None, measured)
    assert annotations[keys.HBM_FREE_MIB] == "98304,98304,98304,98304,98304,49152"  # in 1 GiB steps
    none_free, _ = node_facts("habana.ai/gaudi", cards, health, {c.id for c in cards}, None, measured)
    assert none_free[keys.HBM_FREE_MIB] == "" and none_free[keys.CARDS_FREE] == "0"


def test_pod_resources_client_reads_devices_of_our_resource(tmp_path):
    kubelet = FakePodResources(tmp_path / "pr.sock")
    try:
        kubelet.hold("a", "habana.ai/gaudi", ["0000:19:00.0", "0000:29:00.0"])
        kubelet.hold("b", "nvidia.com/gpu", ["GPU-1"])
        client = PodResourcesClient(tmp_path / "pr.sock")
        assert client.in_use("habana.ai/gaudi") == {"0000:19:00.0", "0000:29:00.0"}
        assert client.in_use("example.com/none") == set()
    finally:
        kubelet.stop()
    assert PodResourcesClient(tmp_path / "absent.sock").in_use("habana.ai/gaudi") is None


def test_publisher_patches_the_node_and_the_extender_reads_it_back(cards, tmp_path):
    pytest.importorskip("kmock")
    from tests.kit.kube import KmockServer

    api_server = KmockServer()
    kubelet = FakePodResources(tmp_path / "pr.sock")
    try:
        kube = api_server.client()
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": "hls-0", "labels": {"example.com/leaf": "leaf-3"}},
            }
        )
        kubelet.hold("worker-0", "habana.ai/gaudi", [cards[0].id, cards[1].id, cards[2].id])
        measured = {cards[3].id: 40_000}  # what the backend's free_memory_mib reports (NVML would)
        publisher = NodePublisher(
            "hls-0",
            "habana.ai/gaudi",
            "example.com/leaf",
            PodResourcesClient(tmp_path / "pr.sock"),
            kube=kube,
            free_memory=lambda: measured,
        )
        health = {c.id: HEALTHY for c in cards}
        assert publisher.publish(cards, health) is True
        assert publisher.publish(cards, health) is False  # nothing changed: no patch

        node = kube.get("v1", "Node", "hls-0")
        assert node["metadata"]["annotations"][keys.CARDS_FREE] == "5"
        assert node["metadata"]["labels"][keys.LEAF_LABEL] == "leaf-3"
        assert keys.FACTS_UPDATED in node["metadata"]["annotations"]

        # what the extender makes of that Node (allocatable as the kubelet would report it)
        raw = dict(node, status={"allocatable": {"habana.ai/gaudi": "8"}})
        facts = facts_of(Node.model_validate(raw), "habana.ai/gaudi", (keys.LEAF_LABEL,))
        assert (facts.cards_total, facts.cards_free, facts.leaf, facts.hbm_per_card_mib) == (8, 5, "leaf-3", 96 * 1024)
        assert facts.hbm_free_mib == (96 * 1024,) * 4 + (39 * 1024,)  # the free cards 3..7, card 3 measured

        health[cards[4].id] = UNHEALTHY
        assert publisher.publish(cards, health) is True
        assert kube.get("v1", "Node", "hls-0")["metadata"]["annotations"][keys.CARDS_FREE] == "4"
    finally:
        kubelet.stop()
        api_server.stop()


def test_publisher_without_an_api_finds_the_cluster_through_kubeconfig(cards, tmp_path, monkeypatch):
    pytest.importorskip("kmock")
    from tests.kit.kube import KmockServer

    api_server = KmockServer()
    try:
        api_server.client().create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "hls-0"}})
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(api_server.kubeconfig("plugin"))
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        publisher = NodePublisher("hls-0", "habana.ai/gaudi", None, None)  # a KubeClient from $KUBECONFIG
        assert publisher.publish(cards, {c.id: HEALTHY for c in cards}) is True
        node = api_server.client().get("v1", "Node", "hls-0")
        assert node["metadata"]["annotations"][keys.CARDS_HEALTHY] == "8"
    finally:
        api_server.stop()
