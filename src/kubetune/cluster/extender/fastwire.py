"""A fast decoder for ExtenderArgs, used when `msgspec` is installed (the pydantic models stay the schema).

At 5,000 nodes the scheduler's request is ~20 MB of v1.Node JSON, and building Python
objects for every image, condition and label costs more than the 100 ms budget. msgspec
decodes into structs that declare only the keys the policy reads (`metadata.name`, the
configured leaf labels, the plugin's annotations, `status.allocatable` of the managed
resources) and skips everything else in C without allocating it, several times faster than
pydantic at that size (BENCHMARKS.md, section 4).

The result is the same as the pydantic path's (tests/cluster/test_decoders.py compares them): the Pod itself is
still validated by pydantic (it is small), and on any decode error the caller re-validates
the body with pydantic, so error messages have one format whichever path is in use.
"""

from __future__ import annotations

import types
from typing import Any

import msgspec
from msgspec.structs import astuple

from kubetune.cluster import nodefacts as keys
from kubetune.cluster.extender.facts import RawNode
from kubetune.cluster.extender.protocol import Pod

# In RawNode's order, so a decoded Annotations struct unpacks straight into it.
ANNOTATIONS = (
    keys.RESOURCE,
    keys.CARDS_HEALTHY,
    keys.CARDS_FREE,
    keys.HBM_PER_CARD_MIB,
    keys.RDMA_LATENCY_US,
    keys.HBM_FREE_MIB,
)
_NO_ANNOTATIONS = (None,) * len(ANNOTATIONS)
_Quantity = str | int | float | None


def _struct(name: str, json_keys: tuple[str, ...], value_type) -> type:
    """A struct with one optional field per JSON key, in that order (`astuple` follows it).

    Keys like `kubetune.io/x` are not identifiers, so fields are f0, f1, ... renamed to them.
    """
    fields = [(f"f{i}", value_type, msgspec.field(default=None, name=k)) for i, k in enumerate(json_keys)]
    return msgspec.defstruct(name, fields, gc=False)


class FastDecoder:
    """Decodes ExtenderArgs bytes into (Pod, [RawNode] | None, NodeNames), like the pydantic path."""

    def __init__(self, resources: tuple[str, ...], leaf_labels: tuple[str, ...]):
        if len(set(leaf_labels)) != len(leaf_labels) or len(set(resources)) != len(resources):
            raise ValueError("leaf labels and resources must not repeat")  # one struct field per key
        labels = _struct("Labels", leaf_labels, str | None)
        annotations = _struct("Annotations", ANNOTATIONS, str | None)
        allocatable = _struct("Allocatable", resources, _Quantity)
        self._n_resources = len(resources)

        # gc=False: thousands of these per call, none in a reference cycle; the collector
        # would otherwise walk them all several times per request.
        # Nullability mirrors protocol.py, so both paths refuse the same malformed values in
        # the fields the policy reads; fields it does not read are skipped unchecked here.
        meta = msgspec.defstruct(
            "Meta",
            [("name", str, ""), ("labels", labels | None, None), ("annotations", annotations | None, None)],
            gc=False,
        )
        status = msgspec.defstruct("Status", [("allocatable", allocatable | None, None)], gc=False)
        node = msgspec.defstruct(
            "Node",
            [
                ("metadata", meta, msgspec.field(default_factory=meta)),
                ("status", status, msgspec.field(default_factory=status)),
            ],
            gc=False,
        )
        node_items = types.GenericAlias(list, (node,))  # list[node], with `node` a class made at runtime
        node_list = msgspec.defstruct("NodeList", [("items", node_items, msgspec.field(default_factory=list))])
        args = msgspec.defstruct(
            "ExtenderArgs",
            [("Pod", msgspec.Raw), ("Nodes", node_list | None, None), ("NodeNames", list[str] | None, None)],
        )
        # Any: the structs are made at runtime, so their fields are unknown to a type checker.
        self._decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(args)
        # /filter hands back the nodes it keeps as they came: each item's JSON text, unparsed
        raw_list = msgspec.defstruct("RawNodeList", [("items", list[msgspec.Raw], msgspec.field(default_factory=list))])
        raw_args = msgspec.defstruct("RawExtenderArgs", [("Nodes", raw_list | None, None)])
        self._raw_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(raw_args)

    def node_json(self, body: bytes) -> list[msgspec.Raw]:
        """The JSON text of each `Nodes.items` entry, in order (a bytes-like Raw each)."""
        nodes = self._raw_decoder.decode(body).Nodes
        return nodes.items if nodes is not None else []

    def decode(self, body: bytes) -> tuple[Pod, list[RawNode] | None, list[str] | None]:
        """-> (Pod, [RawNode] or None, NodeNames). Any error (a Pod pydantic refuses too)
        propagates; the caller then re-validates with pydantic for the message."""
        args = self._decoder.decode(body)
        pod = Pod.model_validate_json(bytes(args.Pod))
        nodes: list[RawNode] | None = None
        if args.Nodes is not None:
            empty_alloc = (None,) * self._n_resources
            nodes = []
            for item in args.Nodes.items:
                meta = item.metadata
                labels, ann, alloc = meta.labels, meta.annotations, item.status.allocatable
                leaf = None
                if labels is not None:
                    for value in astuple(labels):  # the first configured leaf label that is set
                        if value:
                            leaf = value
                            break
                alloc_values = astuple(alloc) if alloc is not None else empty_alloc
                nodes.append(
                    RawNode(meta.name, leaf, alloc_values, *(astuple(ann) if ann is not None else _NO_ANNOTATIONS))
                )
        return pod, nodes, args.NodeNames
