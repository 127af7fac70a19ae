"""The FineTune object (kubetune.io/v1alpha1) as the CLI sees it: `kubetune k8s submit
--via-operator` builds one (pure) and creates it (`submit`, through the given client);
`kubetune k8s status NAME` prints its status. The CRD itself and the
operator that acts on it live in `kubetune.operator` (which imports this layer, not the reverse).
"""

from __future__ import annotations

from typing import Any

from kubetune.errors import UserError
from kubetune.k8s.names import TOKEN_KEY, Names
from kubetune.k8s.progress import format_eta
from kubetune.recipe.schema import Recipe

GROUP = "kubetune.io"
VERSION = "v1alpha1"
KIND = "FineTune"
PLURAL = "finetunes"
API_VERSION = f"{GROUP}/{VERSION}"


def recipe_data(recipe: Recipe) -> dict[str, Any]:
    """The recipe as spec.recipe: the keys that differ from the defaults (the operator's loader
    fills in the rest), without k8s.name / k8s.namespace (the FineTune's own name and namespace)."""
    data: dict[str, Any] = recipe.model_dump(mode="json", exclude_defaults=True)
    k8s = data.get("k8s", {})
    for key in ("name", "namespace", "profile", "api"):  # profile and api go to spec
        k8s.pop(key, None)
    if not k8s:
        data.pop("k8s", None)
    return data


def finetune_object(recipe: Recipe, name: str, with_token: bool, serve: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"recipe": recipe_data(recipe), "profile": recipe.k8s.profile, "api": recipe.k8s.api}
    if with_token:
        spec["hfTokenSecretRef"] = {"name": f"{name}-hf-token", "key": TOKEN_KEY}
    if serve:
        spec["serve"] = {"enabled": True, **serve}
    meta = {"name": name, "namespace": recipe.k8s.namespace}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec}


def status_lines(ft: dict[str, Any]) -> list[str]:
    """What `kubectl get finetune -o yaml` says under status, for people."""
    meta, status = ft["metadata"], ft.get("status") or {}
    lines = [f"FineTune {meta['namespace']}/{meta['name']}: {status.get('phase', 'Pending (not handled yet)')}"]
    p = status.get("progress")
    if p:
        parts = [f"step {p.get('step', '?')}/{p.get('totalSteps', '?')} ({p.get('percent', '?')}%)"]
        parts += [f"loss {p['loss']:.4f}"] if "loss" in p else []
        parts += [f"eval loss {p['evalLoss']:.4f}"] if "evalLoss" in p else []
        parts += [f"tok/s {p['tokensPerSecond']:.1f}"] if "tokensPerSecond" in p else []
        parts += [f"eta {p.get('eta') or format_eta(p.get('etaSeconds'))}"]
        lines.append("progress: " + "  ".join(parts))
    if status.get("endpoint"):
        lines.append(f"endpoint: {status['endpoint']}")
    for c in status.get("conditions") or []:
        head = f"  {c['type']}={c['status']} {c.get('reason', '')}".rstrip()
        message = [m for m in (c.get("message") or "").splitlines() if m]
        lines.append(head + (f": {message[0]}" if message else ""))
        lines += [f"    {m}" for m in message[1:]]
    return lines


def submit(client: Any, ft: dict[str, Any], token: str | None) -> list[str]:
    """Create the FineTune, then its token Secret owned by it (the operator waits for the Secret:
    a missing one is a temporary error it retries). One line per object."""
    from kubetune.k8s.objects import secret
    from kubetune.kubeapi import Conflict

    meta = ft["metadata"]
    try:
        created = client.create(ft)
    except Conflict:
        raise UserError(
            f"FineTune {meta['namespace']}/{meta['name']} exists: `kubectl edit finetune {meta['name']} -n "
            f"{meta['namespace']}` changes it, `kubectl delete finetune ...` removes it"
        ) from None
    lines = [f"created FineTune {meta['namespace']}/{meta['name']}"]
    if token:
        obj = secret(Names.for_job(meta["name"], meta["namespace"]), token)
        obj["metadata"]["ownerReferences"] = [
            {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": created["metadata"]["uid"]}
        ]
        client.create(obj)
        lines.append(f"created Secret {meta['namespace']}/{obj['metadata']['name']} (owned by the FineTune)")
    return lines
