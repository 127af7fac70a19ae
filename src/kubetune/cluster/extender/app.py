"""The HTTP side of the scheduler extender: POST /filter and POST /prioritize (FastAPI).

The routes parse (protocol), convert (facts), call the pure policy, and answer. At 5,000
nodes a request is ~20 MB of JSON and its parse is most of the latency budget, so when
msgspec is installed the body is decoded by `fastwire` (only the keys the policy reads);
otherwise, and for every body the fast path refuses, by the pydantic models in `protocol`.

Both of kube-scheduler's modes (pkg/scheduler/extender.go, HTTPExtender.Filter):
- `nodeCacheCapable: false`: the scheduler sends whole v1.Node objects and takes the
  `Nodes.items` of the filter's answer THEMSELVES as the feasible nodes: it sends those to
  every extender's /prioritize and uses them for the rest of the cycle. So /filter answers
  with each kept node exactly as it received it, never a copy trimmed to its name.
- `nodeCacheCapable: true` (what `render-components` configures with `--watch-pods`): the
  scheduler sends node names only and reads back `NodeNames`. The node facts then come from
  the watch-backed cache; a name the cache does not know yet is kept and scored neutral.

Errors: a body that is not ExtenderArgs gets one 400 `{"Error": "..."}` naming the first
bad field; anything unexpected gets a 500 with the same shape. Either way the scheduler
sees a failed call (and, with `ignorable: true`, carries on without the extender).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from kubetune.cluster import nodefacts as keys
from kubetune.cluster.extender import policy
from kubetune.cluster.extender.facts import PodView, RawNode, facts_from, peers_of, raw_node, request_of
from kubetune.cluster.extender.protocol import ExtenderArgs, Pod

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExtenderConfig:
    resources: tuple[str, ...] = keys.MANAGED_RESOURCES  # in order: a pod asking for several gets the first
    leaf_labels: tuple[str, ...] = (keys.LEAF_LABEL,)  # first one set on a node names its leaf
    weights: policy.Weights = field(default_factory=policy.Weights)

    def __post_init__(self):
        # dict.fromkeys: drop repeats (a repeated --resource flag), keep the order
        object.__setattr__(self, "resources", tuple(dict.fromkeys(self.resources)))
        object.__setattr__(self, "leaf_labels", tuple(dict.fromkeys(self.leaf_labels)))


@dataclass
class Call:
    """One decoded scheduler call: the pod and the node fields the policy reads."""

    pod: Pod
    nodes: list[RawNode] | None  # None: nodeCacheCapable mode (NodeNames only)
    node_names: list[str] | None
    body: bytes = b""  # as received: /filter answers with the nodes it keeps, unchanged


def _fast_decoder(config: ExtenderConfig):
    try:
        from kubetune.cluster.extender.fastwire import FastDecoder
    except ImportError:  # msgspec not installed: the pydantic path alone is correct, only slower
        return None
    return FastDecoder(config.resources, config.leaf_labels)


def decode_call(body: bytes, config: ExtenderConfig, fast=None) -> Call:
    """Bytes -> Call, through the fast decoder when given; raises pydantic's ValidationError."""
    if fast is not None:
        try:
            pod, nodes, names = fast.decode(body)
            return Call(pod, nodes, names, body)
        except Exception:
            pass  # let pydantic accept it or explain what is wrong, in its words
    args = ExtenderArgs.model_validate_json(body)
    nodes = (
        [raw_node(n, config.resources, config.leaf_labels) for n in args.Nodes.items]
        if args.Nodes is not None
        else None
    )
    return Call(args.Pod, nodes, args.NodeNames, body)


def node_json(call: Call, fast=None) -> list[bytes] | list[Any]:
    """The JSON text of each node of the call (bytes-like), in the order of `call.nodes`."""
    if fast is not None:
        try:
            return fast.node_json(call.body)  # msgspec.Raw: a view of the body, not a copy
        except Exception:
            pass  # a body only pydantic accepted: re-encode its nodes
    items = (json.loads(call.body).get("Nodes") or {}).get("items") or []
    return [json.dumps(item, separators=(",", ":")).encode() for item in items]


def _json(body, status: int = 200) -> Response:
    return Response(content=json.dumps(body, separators=(",", ":")), status_code=status, media_type="application/json")


def _filter_result(nodes: list | None, names: list[str] | None, failed: dict, unresolvable: dict) -> Response:
    """ExtenderFilterResult, with `Nodes.items` spliced in from the nodes' JSON texts (bytes-like)."""
    rest = json.dumps(
        {"NodeNames": names, "FailedNodes": failed, "FailedAndUnresolvableNodes": unresolvable, "Error": ""},
        separators=(",", ":"),
    ).encode()
    if nodes is None:
        return Response(content=b'{"Nodes":null,' + rest[1:], media_type="application/json")
    body = b"".join((b'{"Nodes":{"items":[', b",".join(nodes), b"]},", rest[1:]))
    return Response(content=body, media_type="application/json")


def _bad_request(e: Exception) -> Response:
    if isinstance(e, ValidationError):
        err = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        message = f"malformed ExtenderArgs: {where}: {err['msg']}"
        if len(e.errors()) > 1:
            message += f" (and {len(e.errors()) - 1} more problems)"
    else:
        message = f"malformed ExtenderArgs: {e}"
    return _json({"Error": message}, 400)


@functools.cache  # once per process: the misconfiguration holds for every call after
def _warn_no_node_cache() -> None:
    log.warning(
        "kube-scheduler sends node names only (nodeCacheCapable: true), but this extender keeps no node "
        "cache (--stateless): every node is kept and scored neutral; run it with --watch-pods, or set "
        "nodeCacheCapable: false in the scheduler's configuration"
    )


def create_app(config: ExtenderConfig = ExtenderConfig(), pods: PodView | None = None) -> FastAPI:
    from prometheus_client import CollectorRegistry, generate_latest

    from kubetune.contracts.metrics import component_metric, instrument

    registry = CollectorRegistry()
    latency = instrument(component_metric("kubetune_extender_request_seconds"), registry)
    app = FastAPI(title="kubetune scheduler extender", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = config
    app.state.pods = pods

    fast = _fast_decoder(config)

    async def parse(request: Request) -> Call:
        return decode_call(await request.body(), config, fast)

    def candidates(call: Call) -> tuple[list[RawNode], list[str]]:
        """The nodes to judge, and the names (nodeCacheCapable) that no cached node answers to."""
        if call.nodes is not None:
            return call.nodes, []
        names = call.node_names or []
        if pods is None:
            _warn_no_node_cache()
            return [], names
        raws = pods.raw_nodes(names)
        return [r for r in raws if r is not None], [name for name, r in zip(names, raws) if r is None]

    def inputs(pod: Pod, nodes: list[RawNode]):
        req = request_of(pod, config.resources)
        resource = req.resource or config.resources[0]
        index = config.resources.index(resource)
        return req, [facts_from(raw, resource, index, pods) for raw in nodes]

    def timed(verb: str, handler):
        async def route(request: Request) -> Response:
            start = time.perf_counter()
            try:
                args = await parse(request)
            except (ValidationError, ValueError) as e:
                response = _bad_request(e)
            else:
                try:
                    response = handler(args)
                except Exception as e:  # a policy bug must not take the scheduler's extender down
                    log.exception("%s failed", verb)
                    response = _json({"Error": f"internal error in {verb}: {type(e).__name__}: {e}"}, 500)
            latency.labels(verb, str(response.status_code)).observe(time.perf_counter() - start)
            return response

        return route

    def do_filter(call: Call) -> Response:
        nodes, unknown = candidates(call)
        req, facts = inputs(call.pod, nodes)
        kept, failed, unresolvable = policy.filter_nodes(req, facts)
        keep = set(kept).union(unknown)  # a node the cache does not know yet: nothing to hold against it
        if call.nodes is None:
            return _filter_result(None, [name for name in call.node_names or [] if name in keep], failed, unresolvable)
        texts = node_json(call, fast)
        if len(texts) != len(nodes):
            raise ValueError(f"{len(texts)} node texts for {len(nodes)} decoded nodes")
        return _filter_result([text for text, raw in zip(texts, nodes) if raw.name in keep], None, failed, unresolvable)

    def do_prioritize(call: Call) -> Response:
        nodes, unknown = candidates(call)
        req, facts = inputs(call.pod, nodes)
        scores = policy.prioritize(req, facts, peers_of(req, facts, pods), config.weights)
        scores.update(dict.fromkeys(unknown, int(policy.NEUTRAL)))
        hosts = (call.node_names or []) if call.nodes is None else list(scores)
        return _json([{"Host": name, "Score": scores[name]} for name in hosts])

    app.add_api_route("/filter", timed("filter", do_filter), methods=["POST"])
    app.add_api_route("/prioritize", timed("prioritize", do_prioritize), methods=["POST"])

    @app.get("/healthz")
    def healthz():
        return {"ok": True, "pod_cache": pods is not None}

    @app.get("/metrics")
    def metrics():
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return app
