"""The msgspec fast path and the pydantic path must read the same facts and refuse the same bodies."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kubetune.cluster.extender.app import ExtenderConfig, _fast_decoder, decode_call, node_json
from kubetune.cluster.extender.facts import facts_from, request_of

from .samples import extender_args, gaudi_node, training_pod

pytest.importorskip("msgspec")

CONFIG = ExtenderConfig(leaf_labels=("kubetune.io/network-leaf", "topology.kubernetes.io/rack"))


def _facts(call):
    req = request_of(call.pod, CONFIG.resources)
    resource = req.resource or CONFIG.resources[0]
    return (
        req,
        call.nodes,
        [facts_from(raw, resource, CONFIG.resources.index(resource)) for raw in call.nodes or []],
        call.node_names,
    )


BODIES = [
    extender_args(
        training_pod(cards=4),
        [
            gaudi_node("a", free=3, hbm_free=[131072, 131072, 40960]),
            gaudi_node("b", free=None, leaf=None, rdma_latency_us=None),
            gaudi_node("c", model="gaudi2", healthy=6),
        ],
    ),
    extender_args(
        training_pod(cards=1, resource="nvidia.com/gpu"), [gaudi_node("g", resource="nvidia.com/gpu", free=2)]
    ),
    {
        "Pod": {"metadata": {"name": "p"}},
        "Nodes": {
            "items": [
                {"metadata": {"name": "bare"}},
                {
                    "metadata": {"name": "x", "labels": {"topology.kubernetes.io/rack": "r1"}},
                    "status": {"allocatable": {"habana.ai/gaudi": 8}},
                },
            ]
        },
    },
    {"Pod": {"spec": {"containers": [{"resources": {"limits": {"habana.ai/gaudi": "2"}}}]}}, "NodeNames": ["n1", "n2"]},
    {"Pod": {}, "Nodes": {"items": []}},
]


@pytest.mark.parametrize("body", BODIES)
def test_fast_and_pydantic_paths_agree(body):
    raw = json.dumps(body).encode()
    fast = decode_call(raw, CONFIG, _fast_decoder(CONFIG))
    slow = decode_call(raw, CONFIG, None)
    assert _facts(fast) == _facts(slow)


@pytest.mark.parametrize("body", BODIES)
def test_both_paths_hand_back_the_nodes_as_sent(body):
    """/filter answers with the nodes it keeps as they came: both paths give each node's JSON."""
    raw = json.dumps(body).encode()
    sent = (body.get("Nodes") or {}).get("items") or []
    for fast in (_fast_decoder(CONFIG), None):
        texts = node_json(decode_call(raw, CONFIG, fast), fast)
        assert [json.loads(bytes(t)) for t in texts] == sent


@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b"null",
        b"[]",
        b'{"Nodes": {"items": []}}',
        b'{"Pod": null, "Nodes": {"items": []}}',
        b'{"Pod": {}, "Nodes": {"items": [{"metadata": null}]}}',
        b'{"Pod": {}, "Nodes": {"items": [{"metadata": {"name": 3}}]}}',
        b'{"Pod": {}, "Nodes": {"items": [{"metadata": {"name": "a", "annotations": {"kubetune.io/cards-free": 3}}}]}}',
    ],
)
def test_both_paths_refuse_the_same_bodies(raw):
    with pytest.raises(ValidationError):
        decode_call(raw, CONFIG, None)
    with pytest.raises(ValidationError):  # the fast path falls back to pydantic, which explains
        decode_call(raw, CONFIG, _fast_decoder(CONFIG))
