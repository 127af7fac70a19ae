"""The scheduler extender through real HTTP (uvicorn on a loopback port), with full v1 objects."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")

from kubetune.cluster.extender.app import ExtenderConfig, create_app
from kubetune.cluster.extender.podcache import PodCache
from kubetune.cluster.extender.policy import Weights
from kubetune.cluster.extender.server import running

from .samples import extender_args, gaudi_node, training_pod


@pytest.fixture(scope="module")
def url():
    with running(create_app()) as base:
        yield base


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=10) as client:
        yield client


def test_filter_removes_nodes_that_cannot_hold_the_pod_with_reasons(url, http):
    nodes = [
        gaudi_node("hls-0", free=8),
        gaudi_node("hls-1", free=3),  # busy: preemption could help
        gaudi_node("hls-2", cards=4, free=4),  # too small for 8 on one node
        gaudi_node("hls-3", free=8, healthy=6),  # two cards unhealthy: allocatable 6
        gaudi_node("cpu-0", free=None, resource="nvidia.com/gpu", cards=0),
    ]
    r = http.post(f"{url}/filter", json=extender_args(training_pod(cards=8), nodes))
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert [n["metadata"]["name"] for n in body["Nodes"]["items"]] == ["hls-0"]
    assert body["FailedNodes"] == {"hls-1": "3 of 8 habana.ai/gaudi free; the pod needs 8"}
    unres = body["FailedAndUnresolvableNodes"]
    assert set(unres) == {"hls-2", "hls-3", "cpu-0"}
    assert "4 healthy habana.ai/gaudi in total" in unres["hls-2"] and "6 healthy" in unres["hls-3"]
    assert body["Error"] == "" and body["NodeNames"] is None


def test_the_guides_filter_call_gets_the_answer_it_shows(url, http):
    """docs/cluster-components.md's hand-written ExtenderArgs (curl, no checkout needed) still parses and filters."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "cluster-components.md").read_text()
    command = re.search(r"^curl .*?/filter -d '(.*?)'\n# -> (.*)$", guide, re.S | re.M)
    assert command is not None, "the guide's curl of /filter"
    body = http.post(f"{url}/filter", content=command[1], headers={"Content-Type": "application/json"}).json()
    assert [n["metadata"]["name"] for n in body["Nodes"]["items"]] == ["a"]
    assert f"FailedNodes: {json.dumps(body['FailedNodes'])}" in command[2]


def test_prioritize_prefers_the_node_left_least_fragmented(url, http):
    nodes = [gaudi_node("empty", free=8), gaudi_node("half", free=4), gaudi_node("two", free=2)]
    r = http.post(f"{url}/prioritize", json=extender_args(training_pod(cards=2, workers=1), nodes))
    assert r.status_code == 200
    scores = {h["Host"]: h["Score"] for h in r.json()}
    assert set(scores) == {"empty", "half", "two"}
    assert all(isinstance(s, int) and 0 <= s <= 10 for s in scores.values())
    assert scores["two"] > scores["half"] > scores["empty"]


def test_prioritize_prefers_more_hbm_and_lower_rdma_latency(url, http):
    pod = training_pod(cards=4, workers=1)
    hbm = {
        h["Host"]: h["Score"]
        for h in http.post(
            f"{url}/prioritize", json=extender_args(pod, [gaudi_node("g2", model="gaudi2"), gaudi_node("g3")])
        ).json()
    }
    assert hbm["g3"] > hbm["g2"]
    leaky = gaudi_node("leaky", free=4, hbm_free=[131072, 131072, 131072, 20480])  # a free card mostly used
    clean = gaudi_node("clean", free=4, hbm_free=[131072] * 4)
    scores = {
        h["Host"]: h["Score"] for h in http.post(f"{url}/prioritize", json=extender_args(pod, [leaky, clean])).json()
    }
    assert scores["clean"] > scores["leaky"]
    lat = [gaudi_node("near", rdma_latency_us=2.0), gaudi_node("far", rdma_latency_us=8.0)]
    scores = {h["Host"]: h["Score"] for h in http.post(f"{url}/prioritize", json=extender_args(pod, lat)).json()}
    assert scores["near"] > scores["far"]


def test_missing_node_data_is_neutral_not_an_error(url, http):
    bare = {"metadata": {"name": "bare"}, "status": {"allocatable": {"habana.ai/gaudi": "8"}}}
    junk = gaudi_node("junk")
    junk["metadata"]["annotations"].update(
        {"kubetune.io/cards-free": "lots", "kubetune.io/rdma-latency-us": "-3", "kubetune.io/hbm-per-card-mib": "x"}
    )
    nothing = {"metadata": {"name": "nothing"}}
    args = extender_args(training_pod(cards=1), [bare, junk, nothing])
    r = http.post(f"{url}/prioritize", json=args)
    assert r.status_code == 200
    assert {h["Host"]: h["Score"] for h in r.json()} == {"bare": 5, "junk": 5, "nothing": 5}
    f = http.post(f"{url}/filter", json=args).json()
    assert [n["metadata"]["name"] for n in f["Nodes"]["items"]] == ["bare", "junk"]  # free unknown: kept
    assert list(f["FailedAndUnresolvableNodes"]) == ["nothing"]


@pytest.mark.parametrize(
    "body, where",
    [
        (b"{not json", "Invalid JSON"),
        (b"[]", "Input should be an object"),
        (b'{"Nodes": {"items": []}}', "Pod: Field required"),
        (b'{"Pod": {}, "Nodes": {"items": [{"metadata": {"name": 7}}]}}', "Nodes.items.0.metadata.name"),
        (b'{"Pod": {"spec": {"containers": "pytorch"}}, "Nodes": {"items": []}}', "Pod.spec.containers"),
        (b"", "Invalid JSON"),
    ],
)
@pytest.mark.parametrize("verb", ["filter", "prioritize"])
def test_malformed_input_gets_one_clear_400(url, http, verb, body, where):
    r = http.post(f"{url}/{verb}", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["Error"]
    assert error.startswith("malformed ExtenderArgs") and where in error and "\n" not in error


def test_node_names_mode_and_pods_without_cards_pass_through(url, http):
    pod = training_pod(cards=2)
    r = http.post(f"{url}/filter", json={"Pod": pod, "NodeNames": ["a", "b"]})
    assert r.json()["NodeNames"] == ["a", "b"] and r.json()["Nodes"] is None
    cpu_pod = training_pod(cards=2)
    del cpu_pod["spec"]["containers"][0]["resources"]
    nodes = [gaudi_node("x", free=0), gaudi_node("y")]
    f = http.post(f"{url}/filter", json=extender_args(cpu_pod, nodes)).json()
    assert [n["metadata"]["name"] for n in f["Nodes"]["items"]] == ["x", "y"]
    p = http.post(f"{url}/prioritize", json=extender_args(cpu_pod, nodes)).json()
    assert p == [{"Host": "x", "Score": 5}, {"Host": "y", "Score": 5}]


def test_pod_cache_steers_workers_to_their_jobs_leaf(http):
    cache = PodCache(("habana.ai/gaudi",), ("kubetune.io/network-leaf",))
    for name, leaf in (("a1", "leaf-a"), ("a2", "leaf-a"), ("b1", "leaf-b"), ("b2", "leaf-b")):
        cache.apply_node("ADDED", {"metadata": {"name": name, "labels": {"kubetune.io/network-leaf": leaf}}})
    cache.apply_pod("ADDED", training_pod("job1", 0, cards=8, node_name="b1", phase="Running"))
    cache.apply_pod("ADDED", training_pod("other", 0, cards=4, node_name="a1", phase="Running"))
    cache.synced.set()
    nodes = [
        gaudi_node("a1", leaf="leaf-a", free=8),
        gaudi_node("a2", leaf="leaf-a", free=8),
        gaudi_node("b2", leaf="leaf-b", free=8),
    ]
    with running(create_app(ExtenderConfig(), pods=cache)) as base:
        scores = {
            h["Host"]: h["Score"]
            for h in http.post(f"{base}/prioritize", json=extender_args(training_pod("job1", 1, cards=8), nodes)).json()
        }
        assert scores["b2"] > max(scores["a1"], scores["a2"])  # same leaf as the job's master on b1
        # the cache's own count wins over the (stale) annotation: a1 holds a 4-card pod
        f = http.post(f"{base}/filter", json=extender_args(training_pod("job1", 1, cards=8), nodes)).json()
        assert "a1" in f["FailedNodes"] and "4 of 8" in f["FailedNodes"]["a1"]


def test_weights_change_the_answer(http):
    nodes = [gaudi_node("fits", free=2, rdma_latency_us=9.0), gaudi_node("fast", free=8, rdma_latency_us=1.0)]
    args = extender_args(training_pod(cards=2, workers=1), nodes)
    with running(create_app(ExtenderConfig(weights=Weights(fit=1, hbm=0, closeness=0, rdma=0)))) as base:
        fit_only = {h["Host"]: h["Score"] for h in http.post(f"{base}/prioritize", json=args).json()}
    with running(create_app(ExtenderConfig(weights=Weights(fit=0, hbm=0, closeness=0, rdma=1)))) as base:
        rdma_only = {h["Host"]: h["Score"] for h in http.post(f"{base}/prioritize", json=args).json()}
    assert fit_only["fits"] > fit_only["fast"] and rdma_only["fast"] > rdma_only["fits"]


def test_metrics_count_calls(url, http):
    http.post(f"{url}/filter", json=extender_args(training_pod(), [gaudi_node("m")]))
    text = http.get(f"{url}/metrics").text
    assert 'kubetune_extender_request_seconds_count{code="200",verb="filter"}' in text
    assert json.loads(http.get(f"{url}/healthz").text) == {"ok": True, "pod_cache": False}


_values = st.one_of(
    st.none(), st.sampled_from(["0", "1", "3", "8", "16", "-2", "2.5", "96Gi", "x", ""]), st.integers(-1, 12)
)


@st.composite
def _node(draw, i):
    ann = {
        k: draw(st.sampled_from(["0", "2", "8", "nope", "-1", "1e9"]))
        for k in draw(
            st.sets(
                st.sampled_from(
                    [
                        "kubetune.io/cards-free",
                        "kubetune.io/rdma-latency-us",
                        "kubetune.io/hbm-per-card-mib",
                        "kubetune.io/cards-healthy",
                    ]
                )
            )
        )
    }
    alloc = draw(_values)
    node = {
        "metadata": {
            "name": f"n{i}",
            "annotations": ann,
            "labels": {"kubetune.io/network-leaf": draw(st.sampled_from(["a", "b", ""]))},
        }
    }
    if alloc is not None:
        node["status"] = {"allocatable": {"habana.ai/gaudi": alloc if isinstance(alloc, int) else str(alloc)}}
    return node


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 9), st.integers(0, 6).flatmap(lambda n: st.tuples(*[_node(i) for i in range(n)])))
def test_http_never_fails_and_keeps_only_fitting_nodes(url, http, cards, nodes):
    from kubetune.cluster.extender.protocol import parse_count

    pod = training_pod(cards=cards)
    if cards == 0:
        del pod["spec"]["containers"][0]["resources"]
    args = extender_args(pod, list(nodes))
    p = http.post(f"{url}/prioritize", json=args)
    assert p.status_code == 200
    assert sorted(h["Host"] for h in p.json()) == sorted(n["metadata"]["name"] for n in nodes)
    assert all(type(h["Score"]) is int and 0 <= h["Score"] <= 10 for h in p.json())
    f = http.post(f"{url}/filter", json=args)
    assert f.status_code == 200
    by_name = {n["metadata"]["name"]: n for n in nodes}
    for kept in f.json()["Nodes"]["items"]:
        n = by_name[kept["metadata"]["name"]]
        if cards:
            total = parse_count((n.get("status") or {}).get("allocatable", {}).get("habana.ai/gaudi"))
            total = (
                total
                if total is not None
                else parse_count(n["metadata"]["annotations"].get("kubetune.io/cards-healthy"))
            )
            free = parse_count(n["metadata"]["annotations"].get("kubetune.io/cards-free"))
            assert total is not None and total >= cards and (free is None or free >= cards)
