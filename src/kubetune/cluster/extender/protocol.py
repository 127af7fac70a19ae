"""kube-scheduler extender wire types (`k8s.io/kube-scheduler/extender/v1`), as pydantic models.

The extender types carry no JSON tags, so their keys are the Go field names, capitalised
(`Pod`, `Nodes`, `NodeNames`, `FailedNodes`, ...). The embedded Kubernetes objects (v1.Pod,
v1.NodeList) do have tags and keep their usual lower-camel keys (`metadata`, `items`).

The models read only what the policy needs and ignore the rest: a v1.Node is several
kilobytes (images, conditions, addresses) and a request can carry thousands of them, so
validating every field would cost more than the whole policy.
"""

from __future__ import annotations

import re
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ObjectMeta(_Lenient):
    name: str = ""
    namespace: str = ""
    labels: Optional[dict[str, str]] = None
    annotations: Optional[dict[str, str]] = None


Quantity = Union[str, int, float]


class ResourceRequirements(_Lenient):
    limits: Optional[dict[str, Quantity]] = None
    requests: Optional[dict[str, Quantity]] = None


class EnvVar(_Lenient):
    name: str = ""
    value: Optional[str] = None


class Container(_Lenient):
    name: str = ""
    resources: Optional[ResourceRequirements] = None
    env: Optional[list[EnvVar]] = None


class PodSpec(_Lenient):
    containers: list[Container] = Field(default_factory=list)
    init_containers: Optional[list[Container]] = Field(None, alias="initContainers")
    node_name: str = Field("", alias="nodeName")


class Pod(_Lenient):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: PodSpec = Field(default_factory=PodSpec)


class NodeStatus(_Lenient):
    capacity: Optional[dict[str, Quantity]] = None
    allocatable: Optional[dict[str, Quantity]] = None


class Node(_Lenient):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    status: NodeStatus = Field(default_factory=NodeStatus)


class NodeList(_Lenient):
    items: list[Node] = Field(default_factory=list)


class ExtenderArgs(_Lenient):
    """POST body of /filter and /prioritize. `Nodes` when nodeCacheCapable=false, else `NodeNames`."""

    Pod: Pod
    Nodes: Optional[NodeList] = None
    NodeNames: Optional[list[str]] = None


class HostPriority(BaseModel):
    Host: str
    Score: int


class ExtenderFilterResult(BaseModel):
    """The /filter answer. Only node *names* of `Nodes` are read back by the scheduler."""

    Nodes: Optional[dict] = None
    NodeNames: Optional[list[str]] = None
    FailedNodes: dict[str, str] = Field(default_factory=dict)
    FailedAndUnresolvableNodes: dict[str, str] = Field(default_factory=dict)
    Error: str = ""


_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?\s*$")
_SUFFIX = {
    None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


def parse_quantity(value: Quantity | None) -> float | None:
    """A Kubernetes quantity (`8`, `"8"`, `"500m"`, `"96Gi"`) as a number; None if absent or bad."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    m = _QUANTITY.match(value)
    if not m:
        return None
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def parse_count(value: Quantity | None) -> int | None:
    """A whole-card count (extended resources are integers); None if absent, bad or negative."""
    if type(value) is str and value.isascii() and value.isdigit():  # the common case, ~10x faster than the regex
        return int(value)  # (isascii: "¹".isdigit() is True, but int() refuses it)
    q = parse_quantity(value)
    if q is None or q < 0:
        return None
    return int(q)
