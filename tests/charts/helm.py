"""The charts through Helm's own engine, read back the way Helm reads them.

helm-python-sdk bundles Helm v4's Go SDK: `Chart.load(...).render(values, name=..., namespace=...)` is the
template engine `helm install` runs (values coalesced with the chart's defaults and checked against its
values.schema.json), offline. Its output is parsed with `helm_python.values_from_yaml`, i.e. Go's
sigs.k8s.io/yaml, not PyYAML: the two disagree on what Helm's `toYaml` writes (PyYAML reads `2e-05` as a
string, Go as a number), and what reaches the API server is Go's reading.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import helm_python

REPO = Path(__file__).resolve().parents[2]
CHARTS = REPO / "charts"
OPERATOR_CHART = CHARTS / "kubetune-operator"
FINETUNE_CHART = CHARTS / "kubetune-finetune"

# Helm's releaseutil.SplitManifests: a document separator is `---` at the start of a line.
_SEPARATOR = re.compile(r"(?:^|\s*\n)---\s*")

Obj = dict[str, Any]


@functools.cache
def chart(path: Path) -> helm_python.Chart:
    """Loaded once per test process (a Chart is immutable and thread-safe)."""
    return helm_python.Chart.load(str(path))


def parse_manifests(text: str) -> list[Obj]:
    docs = _SEPARATOR.split(text)
    return [obj for doc in docs if doc.strip() and (obj := helm_python.values_from_yaml(doc))]


def render(path: Path, values: dict | None = None, *, name: str = "kt", namespace: str = "kubetune-system") -> dict:
    """{template path: [objects]} as `helm install NAME PATH -n NAMESPACE -f values` would create them
    (NOTES.txt is text for the user, not objects, and is left out)."""
    rendered = chart(path).render(values or {}, name=name, namespace=namespace)
    return {p: parse_manifests(t) for p, t in rendered.items() if not p.endswith("NOTES.txt")}


def objects(path: Path, values: dict | None = None, **kw: str) -> list[Obj]:
    return [obj for objs in render(path, values, **kw).values() for obj in objs]


def key(obj: Obj) -> tuple[str, str, str | None, str]:
    meta = obj["metadata"]
    return (obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])


def by_key(objs: list[Obj]) -> dict[tuple, Obj]:
    """Objects by (apiVersion, kind, namespace, name); two objects with one key would overwrite each other
    at install, so that is an error here."""
    out: dict[tuple, Obj] = {}
    for obj in objs:
        assert key(obj) not in out, f"rendered twice: {key(obj)}"
        out[key(obj)] = obj
    return out


# The labels Helm's conventions add to what kubetune's Python renders: which release, at which version, by what
# tool. Comparing a chart's objects with Python's means comparing everything else.
HELM_LABELS = frozenset(
    {"app.kubernetes.io/instance", "app.kubernetes.io/version", "app.kubernetes.io/managed-by", "helm.sh/chart"}
)


def without_helm_labels(value: Any) -> Any:
    """A copy of an object (or any part of one) without HELM_LABELS, wherever a map holds them: metadata and pod
    template labels, and the selectors, which carry the release too."""
    if isinstance(value, dict):
        return {k: without_helm_labels(v) for k, v in value.items() if k not in HELM_LABELS}
    if isinstance(value, list):
        return [without_helm_labels(v) for v in value]
    return value


def is_hook(obj: Obj) -> bool:
    """A Helm hook (e.g. a `helm test` pod): rendered with the release, created only at its event."""
    return "helm.sh/hook" in (obj["metadata"].get("annotations") or {})


def installed(objs: list[Obj]) -> list[Obj]:
    """What `helm install` creates: every object but the hooks."""
    return [obj for obj in objs if not is_hook(obj)]
