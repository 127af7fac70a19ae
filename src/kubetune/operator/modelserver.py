"""The kopf handlers of ModelServer: one shared server per base model, and the adapters the
FineTunes export into it.

- create / resume: validate the spec, create its objects (`kubetune.k8s.modelserver`), owned.
- a timer (every `interval` seconds): the registry is what the FineTunes of this server
  registered (`serverplan.registry_of`; a FineTune being deleted is out). Each ready replica's
  loaded set (`GET /v1/models`) is compared with it both ways: what is missing is loaded, a
  stale version is unloaded. A load that fails on one replica is retried with backoff (doubling
  from the interval, capped) and shown in status.pods[].failed and the AdaptersLoaded
  condition naming the replica and the reason; the other replicas serve on. The same pass runs
  after an operator restart: nothing of it lives only in memory but the backoff.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import kopf

from kubetune.contracts.serving import DEFAULT_PORT
from kubetune.k8s.finetune import API_VERSION as FT_API_VERSION
from kubetune.k8s.finetune import KIND as FT_KIND
from kubetune.k8s.modelserver import GROUP, PLURAL, VERSION, ModelServerSpec, render_model_server, served_adapters
from kubetune.k8s.names import server_selector
from kubetune.k8s.serve.gateway import OBJECTIVE_API
from kubetune.kubeapi import ClusterError, KubeClient
from kubetune.operator import actions, plan, replicas, serverplan

RESOURCE = (GROUP, VERSION, PLURAL)
RETRY_DELAY_S = 30
log = logging.getLogger("kubetune.operator")


def register(registry: kopf.OperatorRegistry, interval: float) -> None:
    kopf.on.create(*RESOURCE, registry=registry)(_created)
    kopf.on.resume(*RESOURCE, registry=registry)(_created)
    kopf.on.update(*RESOURCE, field="spec", registry=registry)(_created)
    kopf.timer(*RESOURCE, interval=interval, registry=registry)(_make_follow(interval))


def _say(ms: dict[str, Any], message: str, level: int = logging.INFO) -> None:
    name, namespace = actions.meta(ms)
    log.log(level, "[%s/%s] %s", namespace, name, "; ".join(message.splitlines()))


def _set_condition(patch: kopf.Patch, body: dict[str, Any], new: dict[str, Any]) -> None:
    current = patch.status.get("conditions") or (body.get("status") or {}).get("conditions") or []
    patch.status["conditions"] = plan.with_condition(list(current), new, plan.now_text())


def _objects(ms: dict[str, Any], spec: ModelServerSpec) -> list[dict[str, Any]]:
    name, namespace = actions.meta(ms)
    rendered = render_model_server(name, namespace, spec, served_adapters(ms.get("status") or {}))
    claim_kept = spec.retention == "Retain"  # the adapters' files outlive the server unless Delete
    return plan.owned(rendered, ms, delete_claim=not claim_kept)


def _created(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    client: KubeClient = memo["client"]
    ms = copy.deepcopy(dict(body))
    spec = ModelServerSpec.from_dict(ms.get("spec") or {})
    generation = ms["metadata"].get("generation")
    problems = spec.problems()
    if problems:
        _set_condition(patch, ms, plan.condition("Valid", False, "InvalidSpec", "\n".join(problems), generation))
        raise kopf.PermanentError(f"refused: {'; '.join(problems)} (edit the spec to retry)")
    try:
        created = actions.create_all(client, _objects(ms, spec))
    except ClusterError as e:
        raise kopf.TemporaryError(e.problems[0], delay=RETRY_DELAY_S) from None
    _set_condition(patch, ms, plan.condition("Valid", True, "SpecValid", "", generation))
    patch.status.setdefault("phase", "Pending")
    for what in created:
        _say(ms, f"created {what}")


def _make_follow(interval: float) -> Any:
    def _follow(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
        ms = copy.deepcopy(dict(body))
        valid = any(c.get("type") == "Valid" and c.get("status") == "True" for c in _conditions(ms))
        if not valid:
            return
        try:
            reconcile(memo["client"], ms, patch, memo, interval)
        except ClusterError as e:
            raise kopf.TemporaryError(e.problems[0], delay=RETRY_DELAY_S) from None

    return _follow


def _conditions(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return list((obj.get("status") or {}).get("conditions") or [])


def reconcile(client: KubeClient, ms: dict[str, Any], patch: kopf.Patch, memo: kopf.Memo, base_s: float) -> None:
    """Every ready replica holds exactly the registered adapters; status says who holds what."""
    name, namespace = actions.meta(ms)
    spec = ModelServerSpec.from_dict(ms.get("spec") or {})
    finetunes = client.list(FT_API_VERSION, FT_KIND, namespace)
    registry = serverplan.registry_of(name, finetunes)
    # the gateway's objectives follow the registry (new adapters); the rest exists already
    ms_now = {**ms, "status": {**(ms.get("status") or {}), "adapters": list(registry.values())}}
    objects = _objects(ms_now, spec)
    for what in actions.create_all(client, objects):
        _say(ms, f"created {what}")
    _delete_stale_objectives(client, ms, objects)
    pods = client.list("v1", "Pod", namespace, server_selector(name))
    wanted = {served: entry["path"] for served, entry in registry.items()}
    failures: dict[tuple[str, str], serverplan.LoadFailure] = memo.setdefault("load_failures", {})
    aliases = serverplan.alias_weights(registry, spec.weights)
    api_key = actions.server_api_key(client, ms)
    rows = [_sync_replica(ms, r, wanted, failures, base_s) for r in replicas.ready_replicas(pods, api_key)]
    _sync_aliases(ms, memo, rows, aliases, api_key)
    live = {(row["pod"], f["adapter"]) for row in rows for f in row["failed"]}
    for key in [k for k in failures if k not in live]:  # a replica gone, an adapter loaded or unregistered
        failures.pop(key)
    _write_status(ms, patch, spec, registry, rows)


def _delete_stale_objectives(client: KubeClient, ms: dict[str, Any], wanted: list[dict[str, Any]]) -> None:
    """The gateway's InferenceObjectives of adapters no longer registered go (those this server owns)."""
    name, namespace = actions.meta(ms)
    keep = {o["metadata"]["name"] for o in wanted if o["kind"] == "InferenceObjective"}
    uid = ms["metadata"].get("uid")
    for obj in client.list(OBJECTIVE_API, "InferenceObjective", namespace, server_selector(name)):
        owners = {ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or []}
        stale = obj["metadata"]["name"]
        if uid in owners and stale not in keep and client.delete(OBJECTIVE_API, "InferenceObjective", stale, namespace):
            _say(ms, f"deleted InferenceObjective/{stale} (its adapter is no longer registered)")


def _sync_replica(
    ms: dict[str, Any],
    replica: replicas.Replica,
    wanted: dict[str, str],
    failures: dict[tuple[str, str], serverplan.LoadFailure],
    base_s: float,
) -> dict[str, Any]:
    loaded = replicas.loaded_adapters(replica)
    if isinstance(loaded, str):
        row = {"pod": replica.pod, "ip": replica.ip, "port": replica.port, "restarts": replica.restarts}
        return {**row, "loaded": [], "failed": [], "unreachable": loaded}
    to_load, to_unload = serverplan.replica_changes(wanted, loaded)
    for served in to_unload:
        reason = replicas.unload(replica, served)
        if reason is None:
            loaded.discard(served)
            _say(ms, f"unloaded {served} from {replica.pod} (no longer registered)")
        else:
            _say(ms, f"unloading {served} from {replica.pod} failed: {reason}", logging.WARNING)
    failed = []
    now = time.monotonic()
    for served, path in to_load:
        previous = failures.get((replica.pod, served))
        if previous is not None and now < previous.next_try:
            failed.append({"adapter": served, "reason": previous.reason, "attempts": previous.attempts})
            continue
        reason = replicas.load(replica, served, path)
        if reason is None:
            loaded.add(served)
            failures.pop((replica.pod, served), None)
            _say(ms, f"loaded {served} on {replica.pod}")
            continue
        failure = serverplan.failed_again(previous, reason, now, base_s)
        failures[(replica.pod, served)] = failure
        failed.append({"adapter": served, "reason": reason, "attempts": failure.attempts})
        wait = failure.next_try - now
        _say(ms, f"loading {served} on {replica.pod} failed: {reason}; retrying in {wait:.0f}s", logging.WARNING)
    row = {"pod": replica.pod, "ip": replica.ip, "port": replica.port, "restarts": replica.restarts}
    return {**row, "loaded": sorted(loaded), "failed": failed}


def _sync_aliases(
    ms: dict[str, Any],
    memo: kopf.Memo,
    rows: list[dict[str, Any]],
    aliases: dict[str, dict[str, int]],
    api_key: str | None,
) -> None:
    """Send each replica the aliases' weights when they changed for it (a replica that restarted
    reads the registry file's). A replica without the alias route (404) serves the versions by
    their own names only: said once."""
    sent: dict[tuple[str, int], dict[str, dict[str, int]]] = memo.setdefault("aliases_sent", {})
    for row in rows:
        key = (row["pod"], row["restarts"])  # a restarted server holds the registry file's weights again
        if "unreachable" in row or sent.get(key) == aliases:
            continue
        replica = replicas.Replica(row["pod"], row["ip"], row["port"], key=api_key)
        reasons = [r for alias, w in aliases.items() if (r := replicas.set_alias(replica, alias, w))]
        sent[key] = aliases  # tried: a refusal is said once, not every tick
        for reason in reasons:
            _say(ms, f"setting the adapter aliases on {row['pod']} failed: {reason}", logging.WARNING)


def _write_status(
    ms: dict[str, Any],
    patch: kopf.Patch,
    spec: ModelServerSpec,
    registry: dict[str, dict[str, Any]],
    rows: list[dict[str, Any]],
) -> None:
    name, namespace = actions.meta(ms)
    answering = [r for r in rows if "unreachable" not in r]
    patch.status["adapters"] = list(registry.values())
    patch.status["adapterCount"] = len(registry)
    patch.status["pods"] = rows
    patch.status["readyReplicas"] = len(answering)
    patch.status["endpoint"] = f"http://{name}.{namespace}.svc:{DEFAULT_PORT}/v1"
    problems = [f"{r['pod']}: unreachable: {r['unreachable']}" for r in rows if "unreachable" in r]
    problems += [
        f"{r['pod']}: {f['adapter']}: {f['reason']} (attempt {f['attempts']})" for r in rows for f in r["failed"]
    ]
    if not answering:
        patch.status["phase"] = "Pending"
    else:
        patch.status["phase"] = "Degraded" if problems else "Ready"
    reason = "LoadFailed" if problems else "AllLoaded"
    message = "\n".join(problems) or f"{len(registry)} adapters on {len(answering)} replicas"
    _set_condition(patch, ms, plan.condition("AdaptersLoaded", not problems, reason, message))
