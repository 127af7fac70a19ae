"""kube-scheduler's side of the extender protocol, ported to Python for the tests.

A port of `HTTPExtender.Filter` / `Prioritize` / `send` (kubernetes/kubernetes,
pkg/scheduler/extender.go) and of the scheduling cycle's use of them
(`findNodesThatPassExtenders`, the extender part of `prioritizeNodes`, in
pkg/scheduler/schedule_one.go), so that a test drives the real extender over a real socket
the way the scheduler does: the nodes that Filter hands back are the nodes Prioritize sends.

What the port keeps of the Go code, because the extender's correctness depends on it:
- The request is `encoding/json` of `extenderv1.ExtenderArgs`: the type has no JSON tags, so
  the keys are the Go field names, and a nil pointer is `null`. With `nodeCacheCapable` the
  scheduler sends `NodeNames` and `"Nodes": null`; without it, `"Nodes"` (a v1.NodeList:
  `"metadata": {}` and `"items"`) and `"NodeNames": null`.
- The reply is decoded the way `encoding/json` decodes into a struct: a key matches a field
  exactly or, failing that, case-insensitively; unknown keys are ignored; `null` is nil.
- Filter's result: with `nodeCacheCapable` and `NodeNames` non-nil, each name is looked up in
  the nodes sent (an unknown name is an error); else, when `Nodes` is non-nil, the returned
  `Nodes.items` THEMSELVES are the feasible nodes (whatever the extender left in them); else
  there are none. A non-empty `Error`, or any status but 200, is an error.
- The score the scheduler adds: `Score * weight * (MaxNodeScore 100 / MaxExtenderPriority 10)`;
  an error from Prioritize only drops this extender's scores; an error from Filter skips the
  extender when it is `ignorable`, else fails the cycle.

Not ported: TLS, preemption and bind verbs, managedResources' IsInterested (the tests' pods all
ask for a managed resource), and Go's re-encoding of each node through the v1.Node struct
(fields unknown to v1.Node would be dropped; the tests' nodes carry none).
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_NODE_SCORE = 100  # framework.MaxNodeScore
MAX_EXTENDER_PRIORITY = 10  # extenderv1.MaxExtenderPriority


class ExtenderError(Exception):
    """What HTTPExtender.Filter / Prioritize return as `err`."""


def go_field(obj: dict, name: str):
    """encoding/json's field matching: the exact key, else any key equal under case folding."""
    if name in obj:
        return obj[name]
    folded = name.casefold()
    return next((v for k, v in obj.items() if k.casefold() == folded), None)


def _expect(value, kind: type, what: str):
    """encoding/json refuses a JSON value of the wrong type for a field (null is always fine)."""
    if value is not None and not isinstance(value, kind):
        raise ExtenderError(f"json: cannot unmarshal {type(value).__name__} into Go value of type {what}")
    return value


def node_name(node: dict) -> str:
    return (node.get("metadata") or {}).get("name", "")


@dataclass
class HTTPExtender:
    """One `extenders:` entry of a KubeSchedulerConfiguration, as HTTPExtender holds it."""

    url_prefix: str
    filter_verb: str = ""
    prioritize_verb: str = ""
    weight: int = 1
    node_cache_capable: bool = False
    ignorable: bool = False
    http_timeout: float = 5.0  # DefaultExtenderTimeout

    @classmethod
    def from_config(cls, entry: dict, url_prefix: str | None = None) -> HTTPExtender:
        """From a rendered `extenders:` entry; `url_prefix` replaces the in-cluster Service URL."""
        timeout = str(entry.get("httpTimeout", "5s"))
        return cls(
            url_prefix=url_prefix or entry["urlPrefix"],
            filter_verb=entry.get("filterVerb", ""),
            prioritize_verb=entry.get("prioritizeVerb", ""),
            weight=int(entry.get("weight", 1)),
            node_cache_capable=bool(entry.get("nodeCacheCapable", False)),
            ignorable=bool(entry.get("ignorable", False)),
            http_timeout=float(timeout.removesuffix("s")),
        )

    # -- extender.go ---------------------------------------------------------------------
    def args(self, pod: dict, nodes: list[dict]) -> dict:
        """extenderv1.ExtenderArgs for Filter and Prioritize (both build it the same way)."""
        if self.node_cache_capable:
            return {"Pod": pod, "Nodes": None, "NodeNames": [node_name(n) for n in nodes]}
        return {"Pod": pod, "Nodes": {"metadata": {}, "items": list(nodes)}, "NodeNames": None}

    def filter(self, pod: dict, nodes: list[dict]) -> tuple[list[dict], dict[str, str], dict[str, str]]:
        """-> (feasible nodes, FailedNodes, FailedAndUnresolvableNodes); raises ExtenderError."""
        if not self.filter_verb:
            return list(nodes), {}, {}
        from_node_name = {node_name(n): n for n in nodes}
        result = _expect(self.send(self.filter_verb, self.args(pod, nodes)), dict, "extenderv1.ExtenderFilterResult")
        error = _expect(go_field(result, "Error"), str, "string")
        if error:
            raise ExtenderError(error)
        names = _expect(go_field(result, "NodeNames"), list, "[]string")
        node_list = _expect(go_field(result, "Nodes"), dict, "v1.NodeList")
        feasible: list[dict] = []
        if self.node_cache_capable and names is not None:
            for name in names:
                if name not in from_node_name:
                    raise ExtenderError(
                        f"extender {self.url_prefix!r} claims a filtered node {name!r} which is not found "
                        "in the input node list"
                    )
                feasible.append(from_node_name[name])
        elif node_list is not None:
            feasible = list(_expect(go_field(node_list, "items"), list, "[]v1.Node") or [])
        failed = _expect(go_field(result, "FailedNodes"), dict, "FailedNodesMap") or {}
        unresolvable = _expect(go_field(result, "FailedAndUnresolvableNodes"), dict, "FailedNodesMap") or {}
        return feasible, failed, unresolvable

    def prioritize(self, pod: dict, nodes: list[dict]) -> tuple[list[tuple[str, int]], int]:
        """-> ([(Host, Score)], weight); raises ExtenderError."""
        if not self.prioritize_verb:
            return [(node_name(n), 0) for n in nodes], 0
        result = _expect(self.send(self.prioritize_verb, self.args(pod, nodes)), list, "extenderv1.HostPriorityList")
        priorities = []
        for entry in result:
            entry = _expect(entry, dict, "extenderv1.HostPriority") or {}
            score = _expect(go_field(entry, "Score"), int, "int64") or 0
            priorities.append((_expect(go_field(entry, "Host"), str, "string") or "", score))
        return priorities, self.weight

    def send(self, verb: str, args: dict):
        """POST json.Marshal(args) to urlPrefix/verb; anything but 200 is an error."""
        url = urlsplit(self.url_prefix.rstrip("/") + "/" + verb)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=self.http_timeout)
        try:
            body = json.dumps(args, separators=(",", ":")).encode()
            conn.request("POST", url.path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise ExtenderError(f"failed {verb} with extender at URL {url.geturl()}, code {resp.status}")
        try:
            return json.loads(data)
        except ValueError as e:
            raise ExtenderError(f"decoding the {verb} reply: {e}") from None


@dataclass
class Cycle:
    """What one scheduling cycle made of the extender's answers."""

    feasible: list[dict]  # the node objects the rest of the cycle (score plugins, bind) works on
    statuses: dict[str, str]  # node -> why it was filtered out
    extender_scores: dict[str, int]  # node -> what the extender adds to its plugin score


def schedule_one(extender: HTTPExtender, pod: dict, nodes: list[dict]) -> Cycle:
    """findNodesThatPassExtenders, then the extender's part of prioritizeNodes (one extender)."""
    feasible, statuses = list(nodes), {}
    try:
        feasible, failed, unresolvable = extender.filter(pod, nodes)
    except ExtenderError:
        if not extender.ignorable:
            raise
    else:
        statuses = {**{n: m for n, m in failed.items() if n not in unresolvable}, **unresolvable}
    scores: dict[str, int] = {}
    if feasible:
        try:
            priorities, weight = extender.prioritize(pod, feasible)
        except ExtenderError:
            priorities, weight = [], 0  # "No score given by this extender."
        names = {node_name(n) for n in feasible}  # scores are added to the feasible nodes' only
        for host, score in priorities:
            if host in names:
                scores[host] = scores.get(host, 0) + score * weight * (MAX_NODE_SCORE // MAX_EXTENDER_PRIORITY)
    return Cycle(feasible, statuses, scores)
