"""Gateway routing by adapter: an InferencePool over the server's pods and one InferenceObjective
per adapter (Gateway API Inference Extension), so that an Inference Gateway or llm-d's router
picks the replica for each request. Its endpoint picker (EPP) reads each pod's
`vllm:lora_requests_info` (the adapters running and waiting, and max_lora) and prefers a pod that
already holds the request's adapter, then one with a free adapter slot (docs/serving.md).

Versions as vendored in ../shared/schemas and validated by tests/k8s/test_modelserver.py:
InferencePool `inference.networking.k8s.io/v1` (GIE v1.6.0), InferenceObjective
`inference.networking.x-k8s.io/v1alpha2` (GIE v1.5.0, its last release with the kind; llm-d's
router carries it on as `llm-d.ai/v1alpha2`).
"""

from __future__ import annotations

import re

from kubetune.contracts.kube import KubeObject
from kubetune.contracts.serving import DEFAULT_PORT
from kubetune.k8s.serve.plan import Plan

POOL_API = "inference.networking.k8s.io/v1"
OBJECTIVE_API = "inference.networking.x-k8s.io/v1alpha2"
POOL_GROUP = POOL_API.split("/")[0]
EPP_PORT = 9002  # the endpoint picker's ext-proc gRPC port (GIE's default)


def pool_name(plan: Plan) -> str:
    return f"{plan.names.job}-pool"


def inference_pool(plan: Plan, endpoint_picker: str | None = None) -> KubeObject:
    """The server's pods as one pool; the endpoint picker is the Service `<pool>-epp` unless named."""
    spec: KubeObject = {
        "selector": {"matchLabels": dict(plan.selector)},
        "targetPorts": [{"number": DEFAULT_PORT}],
        "endpointPickerRef": {
            "name": endpoint_picker or f"{pool_name(plan)}-epp",
            "port": {"number": EPP_PORT},
            "failureMode": "FailOpen",  # a picker that is down still lets requests through
        },
    }
    return {"apiVersion": POOL_API, "kind": "InferencePool", "metadata": plan.meta(pool_name(plan)), "spec": spec}


def objective_name(adapter: str) -> str:
    """An adapter's served name as an object name (`NAME@v2` -> `name-v2`)."""
    return re.sub(r"[^a-z0-9-]+", "-", adapter.lower()).strip("-")[:63].strip("-")


def inference_objective(plan: Plan, adapter: str, priority: int | None = None) -> KubeObject:
    """One served adapter (a request's `model`) in the pool; priority orders requests when queued."""
    spec: KubeObject = {"poolRef": {"group": POOL_GROUP, "kind": "InferencePool", "name": pool_name(plan)}}
    if priority is not None:
        spec["priority"] = priority
    meta = plan.meta(objective_name(adapter), annotations={"kubetune.io/served-model": adapter})
    return {"apiVersion": OBJECTIVE_API, "kind": "InferenceObjective", "metadata": meta, "spec": spec}
