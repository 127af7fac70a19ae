"""A ModelServer's replicas as the operator reaches them: each ready pod's IP and its `http`
container port (the operator runs in the cluster, as it does for a job's metrics page), and the
runtime adapter routes they serve (vLLM's: `GET /v1/models`, `POST /v1/load_lora_adapter`,
`POST /v1/unload_lora_adapter`). Each call answers None when it worked, else the reason in one
line (the replica's own error message for a 4xx: bad files, another base, out of memory). Every
call carries the server's API key: a ModelServer's replicas require it of every request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from kubetune.contracts.serving import DEFAULT_PORT
from kubetune.k8s.serve.plan import PORT_NAME

MODELS_TIMEOUT_S = 5
LOAD_TIMEOUT_S = 120  # reading an adapter's files from a network volume


@dataclass(frozen=True)
class Replica:
    pod: str
    ip: str
    port: int
    restarts: int = 0  # its containers' restarts: a restarted server starts from the registry file again
    key: str | None = None  # the server's API key (its Secret's api-key)

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    # a pod whose readiness the kubelet has not reported yet counts as Running (no conditions)
    return status.get("phase") == "Running" and bool(status.get("podIP")) and conditions.get("Ready", "True") == "True"


def _port(pod: dict[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == PORT_NAME:
                return int(port["containerPort"])
    return DEFAULT_PORT


def _restarts(pod: dict[str, Any]) -> int:
    return sum(cs.get("restartCount", 0) for cs in (pod.get("status") or {}).get("containerStatuses") or [])


def ready_replicas(pods: list[dict[str, Any]], key: str | None) -> list[Replica]:
    out = [Replica(p["metadata"]["name"], p["status"]["podIP"], _port(p), _restarts(p), key) for p in pods if _ready(p)]
    return sorted(out, key=lambda r: r.pod)


def _reason(response: httpx.Response) -> str:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:300]
    return f"HTTP {response.status_code}: {message}"


def loaded_adapters(replica: Replica) -> set[str] | str:
    """The adapters the replica serves (models with a parent), or why it could not say."""
    try:
        response = httpx.get(f"{replica.url}/v1/models", headers=replica.headers, timeout=MODELS_TIMEOUT_S)
    except httpx.HTTPError as e:
        return f"unreachable: {e}"
    if response.status_code != 200:
        return _reason(response)
    return {m["id"] for m in response.json().get("data") or [] if m.get("parent")}


def load(replica: Replica, name: str, path: str) -> str | None:
    body = {"lora_name": name, "lora_path": path}
    return _post(replica, "/v1/load_lora_adapter", body, LOAD_TIMEOUT_S)


def unload(replica: Replica, name: str) -> str | None:
    return _post(replica, "/v1/unload_lora_adapter", {"lora_name": name}, MODELS_TIMEOUT_S)


def set_alias(replica: Replica, alias: str, weights: dict[str, int]) -> str | None:
    """Route the plain adapter name to its versions by weight (the serving side's alias route)."""
    return _post(replica, "/v1/lora_aliases", {"alias": alias, "weights": weights}, MODELS_TIMEOUT_S)


def _post(replica: Replica, path: str, body: dict[str, Any], timeout: float) -> str | None:
    try:
        response = httpx.post(f"{replica.url}{path}", json=body, headers=replica.headers, timeout=timeout)
    except httpx.HTTPError as e:
        return f"unreachable: {e}"
    return None if response.status_code == 200 else _reason(response)
