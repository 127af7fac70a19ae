"""The HTTP side of the scheduler extender: POST /filter and POST /prioritize (FastAPI).

The routes parse (protocol), convert (facts), call the pure policy, and answer. At 5,000
nodes a request is ~20 MB of JSON and its parse is most of the latency budget, so when
msgspec is installed the body is decoded by `fastwire` (only the keys the policy reads);
otherwise, and for every body the fast path refuses, by the pydantic models in `protocol`.

Errors: a body that is not ExtenderArgs gets one 400 `{"Error": "..."}` naming the first
bad field; anything unexpected gets a 500 with the same shape. Either way the scheduler
sees a failed call (and, with `ignorable: true`, carries on without the extender).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

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
            return Call(*fast.decode(body))
        except Exception:
            pass  # let pydantic accept it or explain what is wrong, in its words
    args = ExtenderArgs.model_validate_json(body)
    nodes = (
        [raw_node(n, config.resources, config.leaf_labels) for n in args.Nodes.items]
        if args.Nodes is not None
        else None
    )
    return Call(args.Pod, nodes, args.NodeNames)


def _json(body, status: int = 200) -> Response:
    return Response(content=json.dumps(body, separators=(",", ":")), status_code=status, media_type="application/json")


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


def create_app(config: ExtenderConfig = ExtenderConfig(), pods: PodView | None = None) -> FastAPI:
    from prometheus_client import CollectorRegistry, generate_latest

    from kubetune.monitor.contract import component_metric, instrument

    registry = CollectorRegistry()
    latency = instrument(component_metric("kubetune_extender_request_seconds"), registry)
    app = FastAPI(title="kubetune scheduler extender", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = config
    app.state.pods = pods

    fast = _fast_decoder(config)

    async def parse(request: Request) -> Call:
        return decode_call(await request.body(), config, fast)

    def inputs(call: Call):
        req = request_of(call.pod, config.resources)
        resource = req.resource or config.resources[0]
        index = config.resources.index(resource)
        facts = [facts_from(raw, resource, index, pods) for raw in call.nodes or []]
        return req, facts

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

    def do_filter(args: Call) -> Response:
        if args.nodes is None:  # nodeCacheCapable mode: no node data to judge, keep every name
            return _json(
                {
                    "Nodes": None,
                    "NodeNames": args.node_names or [],
                    "FailedNodes": {},
                    "FailedAndUnresolvableNodes": {},
                    "Error": "",
                }
            )
        req, facts = inputs(args)
        kept, failed, unresolvable = policy.filter_nodes(req, facts)
        # The scheduler reads back only the names of the nodes it gets (extender.go), so
        # answering with metadata.name alone keeps a 5,000-node reply small.
        return _json(
            {
                "Nodes": {"items": [{"metadata": {"name": name}} for name in kept]},
                "NodeNames": None,
                "FailedNodes": failed,
                "FailedAndUnresolvableNodes": unresolvable,
                "Error": "",
            }
        )

    def do_prioritize(args: Call) -> Response:
        if args.nodes is None:
            return _json([{"Host": name, "Score": int(policy.NEUTRAL)} for name in args.node_names or []])
        req, facts = inputs(args)
        scores = policy.prioritize(req, facts, peers_of(req, facts, pods), config.weights)
        return _json([{"Host": name, "Score": score} for name, score in scores.items()])

    app.add_api_route("/filter", timed("filter", do_filter), methods=["POST"])
    app.add_api_route("/prioritize", timed("prioritize", do_prioritize), methods=["POST"])

    @app.get("/healthz")
    def healthz():
        return {"ok": True, "pod_cache": pods is not None}

    @app.get("/metrics")
    def metrics():
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return app
