"""kube-scheduler extender wire types (`k8s.io/kube-scheduler/extender/v1`), as pydantic models.

The extender types carry no JSON tags, so their keys are the Go field names, capitalised
(`Pod`, `Nodes`, `NodeNames`, `FailedNodes`, ...). The embedded Kubernetes objects (v1.Pod,
v1.NodeList) do have tags and keep their usual lower-camel keys (`metadata`, `items`).

The models read only what the policy needs and ignore the rest: a v1.Node is several
kilobytes (images, conditions, addresses) and a request can carry thousands of them, so
validating every field would cost more than the whole policy.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from kubetune.contracts.kube import KubeObject, quantity_or_none


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ObjectMeta(_Lenient):
    name: str = ""
    namespace: str = ""
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


Quantity = str | int | float


class ResourceRequirements(_Lenient):
    limits: dict[str, Quantity] | None = None
    requests: dict[str, Quantity] | None = None


class EnvVar(_Lenient):
    name: str = ""
    value: str | None = None


class Container(_Lenient):
    name: str = ""
    resources: ResourceRequirements | None = None
    env: list[EnvVar] | None = None


class PodResourceClaim(_Lenient):
    name: str = ""


class PodSpec(_Lenient):
    containers: list[Container] = Field(default_factory=list)
    init_containers: list[Container] | None = Field(None, alias="initContainers")
    node_name: str = Field("", alias="nodeName")
    # DRA (Kubernetes 1.34+): the pod's cards come from these claims, not from extended resources
    resource_claims: list[PodResourceClaim] | None = Field(None, alias="resourceClaims")


class Pod(_Lenient):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: PodSpec = Field(default_factory=PodSpec)


class NodeStatus(_Lenient):
    capacity: dict[str, Quantity] | None = None
    allocatable: dict[str, Quantity] | None = None


class Node(_Lenient):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    status: NodeStatus = Field(default_factory=NodeStatus)


class NodeList(_Lenient):
    items: list[Node] = Field(default_factory=list)


class ExtenderArgs(_Lenient):
    """POST body of /filter and /prioritize. `Nodes` when nodeCacheCapable=false, else `NodeNames`."""

    Pod: Pod
    Nodes: NodeList | None = None
    NodeNames: list[str] | None = None


class HostPriority(BaseModel):
    Host: str
    Score: int


class ExtenderFilterResult(BaseModel):
    """The /filter answer. Only node *names* of `Nodes` are read back by the scheduler."""

    Nodes: KubeObject | None = None
    NodeNames: list[str] | None = None
    FailedNodes: dict[str, str] = Field(default_factory=dict)
    FailedAndUnresolvableNodes: dict[str, str] = Field(default_factory=dict)
    Error: str = ""


def parse_count(value: Quantity | None) -> int | None:
    """A whole-card count (extended resources are integers); None if absent, bad or negative."""
    if type(value) is str and value.isascii() and value.isdigit():  # the common case, ~10x faster than the regex
        return int(value)  # (isascii: "¹".isdigit() is True, but int() refuses it)
    q = quantity_or_none(value)
    if q is None or not 0 <= q < math.inf:  # also refuses "1e400" (inf) and NaN, which int() cannot take
        return None
    return int(q)
