"""The extender policy: unit cases and hypothesis properties (scores 0..10, filter never keeps a misfit)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubetune.cluster.extender.facts import facts_of, request_of
from kubetune.cluster.extender.policy import NodeFacts, Peers, Request, Weights, explain, filter_nodes, prioritize
from kubetune.cluster.extender.protocol import Node, Pod
from kubetune.errors import UserError

from .samples import gaudi_node, training_pod

maybe_int = st.one_of(st.none(), st.integers(min_value=-2, max_value=20))
maybe_float = st.one_of(
    st.none(), st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=0.1, max_value=1e6)
)

node_facts = st.builds(
    NodeFacts,
    name=st.uuids().map(str),
    cards_total=maybe_int,
    cards_free=maybe_int,
    hbm_per_card_mib=maybe_float,
    leaf=st.one_of(st.none(), st.sampled_from(["l0", "l1", "l2"])),
    rdma_latency_us=maybe_float,
    hbm_free_mib=st.one_of(st.none(), st.lists(st.floats(0, 1e6), max_size=8).map(lambda v: tuple(sorted(v))[::-1])),
)
requests = st.builds(
    Request,
    resource=st.sampled_from(["habana.ai/gaudi", None]),
    cards=st.integers(min_value=0, max_value=16),
    job=st.one_of(st.none(), st.just("ns/job")),
    gang_size=st.one_of(st.none(), st.integers(min_value=1, max_value=16)),
)
weights = st.builds(
    Weights, fit=st.floats(0, 10), hbm=st.floats(0, 10), closeness=st.floats(0, 10), rdma=st.floats(0.01, 10)
)
peers = st.builds(
    lambda nodes, leaves: Peers(Counter(nodes), Counter(leaves)),
    st.dictionaries(st.sampled_from(["n0", "n1"]), st.integers(1, 4)),
    st.dictionaries(st.sampled_from(["l0", "l1", "l9"]), st.integers(1, 4)),
)


@settings(max_examples=300, deadline=None)
@given(requests, st.lists(node_facts, max_size=12, unique_by=lambda n: n.name), peers, weights)
def test_scores_are_integers_in_0_to_10_for_every_node(req, nodes, p, w):
    scores = prioritize(req, nodes, p, w)
    assert set(scores) == {n.name for n in nodes}
    assert all(type(s) is int and 0 <= s <= 10 for s in scores.values())


@settings(max_examples=300, deadline=None)
@given(requests, st.lists(node_facts, max_size=12, unique_by=lambda n: n.name))
def test_filter_never_keeps_a_node_that_cannot_fit(req, nodes):
    kept, failed, unresolvable = filter_nodes(req, nodes)
    by_name = {n.name: n for n in nodes}
    assert set(kept) | set(failed) | set(unresolvable) == set(by_name)
    assert not (set(kept) & set(failed)) and not (set(kept) & set(unresolvable))
    if req.cards > 0 and req.resource is not None:
        for name in kept:
            n = by_name[name]
            assert n.cards_total is not None and n.cards_total >= req.cards
            assert n.cards_free is None or n.cards_free >= req.cards
        for name in unresolvable:
            assert by_name[name].cards_total is None or by_name[name].cards_total < req.cards


annotation_values = st.one_of(st.text(max_size=6), st.sampled_from(["8", "0", "-1", "3.5", "96Gi", "1e3", "NaN", ""]))


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "kubetune.io/cards-free",
                "kubetune.io/cards-healthy",
                "kubetune.io/hbm-per-card-mib",
                "kubetune.io/rdma-latency-us",
                "kubetune.io/resource",
            ]
        ),
        annotation_values,
    ),
    st.one_of(st.none(), annotation_values, st.integers(-3, 20)),
    st.integers(0, 9),
)
def test_any_node_annotations_give_a_score_never_an_exception(annotations, allocatable, cards):
    raw = {
        "metadata": {"name": "n", "annotations": annotations},
        "status": {"allocatable": {} if allocatable is None else {"habana.ai/gaudi": allocatable}},
    }
    node = Node.model_validate(raw)
    req = request_of(Pod.model_validate(training_pod(cards=cards)), ("habana.ai/gaudi",))
    facts = [facts_of(node, "habana.ai/gaudi", ("kubetune.io/network-leaf",)), NodeFacts("m", 8, 8)]
    kept, _, _ = filter_nodes(req, facts)
    scores = prioritize(req, facts)
    assert 0 <= scores["n"] <= 10
    if "n" in kept and req.cards:
        assert facts[0].cards_total >= req.cards


def test_best_fit_and_closeness_order():
    req = Request("habana.ai/gaudi", 2, job="ns/j", gang_size=4)
    nodes = [NodeFacts("a", 8, 2, leaf="l0"), NodeFacts("b", 8, 8, leaf="l0"), NodeFacts("c", 8, 2, leaf="l1")]
    alone = explain(req, nodes)
    assert alone["a"].fit == 10 and alone["b"].fit == 2.5
    # first worker: leaf l0 has room for 2+8 -> 10 cards >= 8 needed; l1 only 2
    assert alone["a"].closeness == 10 and alone["c"].closeness == 2.5
    placed = explain(req, nodes, Peers(Counter({"x": 1}), Counter({"l1": 1})))
    assert placed["c"].closeness == 9 and placed["a"].closeness == 0
    final = prioritize(req, nodes, Peers(Counter({"x": 1}), Counter({"l1": 1})))
    assert final == {"a": 4, "b": 1, "c": 9}  # (3*fit + 5*closeness) / 8; hbm and rdma are constant


def test_constant_components_do_not_flatten_the_range():
    req = Request("habana.ai/gaudi", 1)
    scores = prioritize(req, [NodeFacts("full", 8, 1), NodeFacts("empty", 8, 8)])
    assert scores == {"full": 10, "empty": 1}  # only `fit` differs, so it sets the whole 0..10


def test_weights_are_validated_with_the_flag_name():
    assert Weights.parse("fit=1, rdma=0") == Weights(fit=1, hbm=1, closeness=5, rdma=0)
    with pytest.raises(UserError) as e:
        Weights.parse("fit=x,numa=2")
    assert len(e.value.problems) == 2 and all(p.startswith("--weights") for p in e.value.problems)
    with pytest.raises(UserError, match=">= 0"):
        Weights(fit=-1)
    with pytest.raises(UserError, match="at least one"):
        Weights(0, 0, 0, 0)


def test_quantities_and_requests():
    from kubetune.contracts.kube import quantity_or_none

    assert quantity_or_none("96Gi") == 96 * 2**30 and quantity_or_none("500m") == 0.5 and quantity_or_none("x") is None
    pod = Pod.model_validate(training_pod("j", 2, cards=4, workers=3))
    req = request_of(pod, ("nvidia.com/gpu", "habana.ai/gaudi"))
    assert req == Request("habana.ai/gaudi", 4, job="kubetune/j", gang_size=3)
    init = training_pod(cards=1)
    init["spec"]["initContainers"] = [{"name": "warm", "resources": {"limits": {"habana.ai/gaudi": "8"}}}]
    assert request_of(Pod.model_validate(init), ("habana.ai/gaudi",)).cards == 8


def test_sample_node_round_trips_into_facts():
    f = facts_of(
        Node.model_validate(gaudi_node("n", free=5, leaf="l3", model="gaudi2", rdma_latency_us=2.5)),
        "habana.ai/gaudi",
        ("kubetune.io/network-leaf",),
    )
    assert f == NodeFacts("n", cards_total=8, cards_free=5, hbm_per_card_mib=96 * 1024, leaf="l3", rdma_latency_us=2.5)


def test_unicode_digits_are_not_counts():
    from kubetune.cluster.extender.protocol import parse_count

    assert parse_count("¹") is None and parse_count("٣") is None and parse_count("12") == 12  # found by hypothesis
    assert parse_count("1e400") is None and parse_count("-1") is None and parse_count("2e0") == 2  # inf, negative


def test_hbm_is_the_free_memory_the_pods_cards_can_have():
    # two gaudi3 nodes of the same card size; on "leaky" two of the free cards are partly used
    full = 128 * 1024
    nodes = [
        NodeFacts("clean", 8, 4, full, hbm_free_mib=(full,) * 4),
        NodeFacts("leaky", 8, 4, full, hbm_free_mib=(full, full, 40_000.0, 30_000.0)),
        NodeFacts("unknown", 8, 4, full),  # an older plugin: the per-card size stands in
    ]
    two, four = Request("habana.ai/gaudi", 2), Request("habana.ai/gaudi", 4)
    assert {n: b.hbm for n, b in explain(two, nodes).items()} == {"clean": 10, "leaky": 10, "unknown": 10}
    by_four = explain(four, nodes)
    assert by_four["clean"].hbm == 10 and by_four["leaky"].hbm == 10 * 30_000 / full and by_four["unknown"].hbm == 10
    assert prioritize(four, nodes)["clean"] > prioritize(four, nodes)["leaky"]
    few = NodeFacts("few", 8, 1, full, hbm_free_mib=(full,))
    assert explain(two, [few, nodes[0]])["few"].hbm == 0  # fewer free cards than asked for


def test_pod_cache_trims_the_published_free_hbm_to_the_cards_still_free():
    from kubetune.cluster.extender.facts import facts_from, raw_node

    node = Node.model_validate(gaudi_node("n", free=4, hbm_free=[131072, 131072, 65536, 32768]))
    raw = raw_node(node, ("habana.ai/gaudi",), ("kubetune.io/network-leaf",))
    assert facts_from(raw, "habana.ai/gaudi", 0).hbm_free_mib == (131072, 131072, 65536, 32768)

    class Cache:  # a pod cache that saw two more cards taken since the plugin published
        def used_cards(self, node, resource):
            return 6

        def peers(self, namespace, job):
            return Counter()

        def leaf_of(self, node):
            return None

    # which two were taken is unknown: keep the two smallest (the worst case)
    assert facts_from(raw, "habana.ai/gaudi", 0, Cache()).hbm_free_mib == (65536, 32768)
    bad = raw._replace(hbm_free_mib="131072,lots")
    assert facts_from(bad, "habana.ai/gaudi", 0).hbm_free_mib is None  # malformed: unknown, never an error
