"""The scheduler extender and pods that claim their cards through DRA (k8s.devices=dra), over real HTTP.

Such a pod (rendered by kubetune itself here) carries spec.resourceClaims and no extended resource: the
extender must not filter nodes by free-card counts it cannot match to the claim, nor score bin packing
on them, and still scores what it knows (RDMA latency, where the job's other workers run).
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")

from kubetune.cluster import nodefacts as keys
from kubetune.cluster.extender.app import create_app
from kubetune.cluster.extender.podcache import PodCache
from kubetune.cluster.extender.server import running
from kubetune.k8s.render import render
from kubetune.recipe.loader import load_recipe

from .samples import extender_args, gaudi_node, training_pod

pytestmark = pytest.mark.process  # a uvicorn server on a loopback port

JOB, NAMESPACE = "llama-lora", "kubetune"


def claim_pod(index: int = 0, node_name: str | None = None, phase: str = "Pending") -> dict:
    """Worker `index` of a 4-worker k8s.devices=dra job, as the Kubeflow operator creates it from
    the rendered PyTorchJob (its labels and PET_NNODES added)."""
    recipe = load_recipe(
        "smollm2-135m-lora-cpu",
        ["k8s.profile=gaudi", "k8s.devices=dra", f"k8s.name={JOB}", "k8s.replicas=4", "k8s.resources.accelerators=8"],
    ).recipe
    (job,) = [o for o in render(recipe).objects if o["kind"] == "PyTorchJob"]
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    spec = dict(template["spec"])
    container = dict(spec["containers"][0])
    container["env"] = [*container["env"], {"name": "PET_NNODES", "value": "4"}]
    spec["containers"] = [container]
    if node_name:
        spec["nodeName"] = node_name
    labels = {**template["metadata"]["labels"], keys.KUBEFLOW_JOB_LABEL: JOB}
    meta = {"name": f"{JOB}-worker-{index}", "namespace": NAMESPACE, "labels": labels}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": {"phase": phase}}


def dra_node(name: str, rdma_latency_us: float | None, leaf: str = "leaf-00") -> dict:
    """A node whose cards only the DRA driver offers: no extended resource, no device plugin facts;
    the network prober's latency and the leaf label as on any node."""
    annotations = {keys.RDMA_LATENCY_US: str(rdma_latency_us)} if rdma_latency_us is not None else {}
    return {
        "metadata": {"name": name, "labels": {keys.LEAF_LABEL: leaf}, "annotations": annotations},
        "status": {"allocatable": {"cpu": "160", "memory": "1000Gi", "pods": "110"}},
    }


@pytest.fixture(scope="module")
def url():
    with running(create_app()) as base:
        yield base


def _post(url: str, verb: str, pod: dict, nodes: list[dict]):
    r = httpx.post(f"{url}/{verb}", json=extender_args(pod, nodes), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_claim_pod_carries_claims_and_no_card_request():
    container = claim_pod()["spec"]["containers"][0]
    assert container["resources"]["claims"] == [{"name": "cards"}]
    assert "habana.ai/gaudi" not in container["resources"]["requests"]


def test_the_filter_keeps_every_node_for_a_claim_pod(url):
    nodes = [
        dra_node("dra-0", 3.0),
        gaudi_node("busy", free=0),  # plugin facts say no card free: not the claim's business
        gaudi_node("small", cards=4, free=4),
    ]
    body = _post(url, "filter", claim_pod(), nodes)
    assert [n["metadata"]["name"] for n in body["Nodes"]["items"]] == ["dra-0", "busy", "small"]
    assert body["FailedNodes"] == {} and body["FailedAndUnresolvableNodes"] == {}
    # the same nodes refuse a device-plugin pod of 8 cards: the difference is the claim
    plugin = _post(url, "filter", training_pod(cards=8), nodes)
    assert set(plugin["FailedNodes"]) | set(plugin["FailedAndUnresolvableNodes"]) == {"dra-0", "busy", "small"}


def test_a_claim_pod_is_scored_by_rdma_latency_not_by_free_cards(url):
    nodes = [gaudi_node("tight", free=1, rdma_latency_us=9.0), gaudi_node("roomy", free=8, rdma_latency_us=3.0)]
    claimed = {s["Host"]: s["Score"] for s in _post(url, "prioritize", claim_pod(), nodes)}
    assert claimed["roomy"] > claimed["tight"]  # lower latency; the free counts are not the claim's
    # a 1-card device-plugin pod packs onto the node it fills exactly, latency notwithstanding
    packed = {s["Host"]: s["Score"] for s in _post(url, "prioritize", training_pod(cards=1), nodes)}
    assert packed["tight"] > packed["roomy"]
    no_facts = [dra_node("a", None), dra_node("b", None)]  # nothing tells them apart: neutral
    assert {s["Score"] for s in _post(url, "prioritize", claim_pod(), no_facts)} == {5}


def test_a_claim_pod_goes_where_its_job_already_runs():
    cache = PodCache(("habana.ai/gaudi",), (keys.LEAF_LABEL,))
    for name, leaf in (("a1", "leaf-a"), ("a2", "leaf-a"), ("b1", "leaf-b")):
        cache.apply_node("ADDED", {"metadata": {"name": name, "labels": {keys.LEAF_LABEL: leaf}}})
    cache.apply_pod("ADDED", claim_pod(0, node_name="a1", phase="Running"))
    cache.synced.set()
    nodes = [dra_node("a2", 3.0, leaf="leaf-a"), dra_node("b1", 3.0, leaf="leaf-b")]
    with running(create_app(pods=cache)) as base:
        scores = {s["Host"]: s["Score"] for s in _post(base, "prioritize", claim_pod(1), nodes)}
    assert scores["a2"] > scores["b1"]  # the first worker's leaf
