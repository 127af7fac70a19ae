"""Validate rendered objects offline: every object is checked or reported as uncheckable.

- Core kinds (Namespace, Pod, PVC, ...): `kubernetes_validate` in strict mode (unknown fields
  are errors) against Kubernetes KUBERNETES_VERSION.
- PyTorchJob, TrainJob, ClusterTrainingRuntime, Kueue's LocalQueue, ClusterQueue,
  ResourceFlavor and Topology, and the Prometheus Operator's PodMonitor, ServiceMonitor and
  PrometheusRule: the CRD's `openAPIV3Schema` with jsonschema's Draft4Validator; for Kueue and
  Trainer v2 also the CRD's CEL rules (`CEL_CHECKED`), and a Kueue topology annotation against the
  Topology rendered with it. The CRDs are vendored in `kubetune/k8s/crds/` (Apache-2.0, see its
  README) so an installed kubetune (and the tests, in a fresh clone) can check; a `crd_dir` given
  replaces the Kubeflow and Kueue ones (the monitoring CRDs always come from the package).
  A CRD schema is weaker than the API server (CEL rules only where evaluated, unknown fields
  are pruned, not rejected), so the CRD check also rejects fields the schema does not declare.
- PodGroup (coscheduling, Volcano): no upstream schema ships here, so a minimal one written
  from the field names kubetune renders; said so in each result.
Any other kind is an error ("cannot check"), never a silent pass.
"""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path

import yaml

from kubetune.k8s import kueue

KUBERNETES_VERSION = "1.35.0"  # matches the kubernetes 35.x client that builds the models

CRD_FILES = {
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.yaml",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainer.kubeflow.org_trainjobs.yaml",
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): "trainer.kubeflow.org_clustertrainingruntimes.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"): (
        "inference.networking.x-k8s.io_inferenceobjectives.yaml"
    ),
    **{
        ("kueue.x-k8s.io/v1beta2", kind): f"kueue.x-k8s.io_{plural}.yaml"
        for kind, plural in (
            ("LocalQueue", "localqueues"),
            ("ClusterQueue", "clusterqueues"),
            ("ResourceFlavor", "resourceflavors"),
            ("Topology", "topologies"),
        )
    },
}
# Checked against the package's copies whatever `crd_dir` says (the monitoring ones: ../shared/schemas lacks them).
VENDORED_ONLY = {key for key in CRD_FILES if key[0].startswith(("monitoring.coreos.com/", "inference.networking."))}
# Whose `x-kubernetes-validations` CEL rules are evaluated too (cel-python): they say what the
# schemas cannot (Kueue: a Topology's hostname level comes last, a flavor of a Topology has node
# labels, every flavor quotas each covered resource; Trainer v2: a TrainJob's name is an RFC 1035
# label, one mlPolicy). Transition rules (`oldSelf`) need an update: skipped.
CEL_CHECKED = {key for key in CRD_FILES if key[0].startswith(("kueue.x-k8s.io/", "trainer.kubeflow.org/"))}

_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": {"type": "object"}},
}
MINIMAL_SCHEMAS = {
    ("scheduling.x-k8s.io/v1alpha1", "PodGroup"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["minMember"],
                "additionalProperties": False,
                "properties": {
                    "minMember": {"type": "integer", "minimum": 1},
                    "scheduleTimeoutSeconds": {"type": "integer", "minimum": 1},
                    "minResources": {"type": "object"},
                },
            },
        },
    },
    ("scheduling.volcano.sh/v1beta1", "PodGroup"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["minMember"],
                "additionalProperties": False,
                "properties": {
                    "minMember": {"type": "integer", "minimum": 1},
                    "queue": {"type": "string"},
                    "priorityClassName": {"type": "string"},
                    "minResources": {"type": "object"},
                },
            },
        },
    },
}


def vendored_crd_dir() -> Path:
    return Path(str(importlib.resources.files("kubetune.k8s").joinpath("crds")))


@functools.cache
def _crd_schema(path: str, version: str) -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are ~1 MB: libyaml is 10x faster
    with open(path, encoding="utf-8") as f:
        crd = yaml.load(f, Loader=loader)
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise LookupError(f"{path} has no version {version}")


@functools.cache
def _validator(schema_key: tuple):
    import jsonschema

    kind, source = schema_key
    schema = _crd_schema(*source) if kind == "crd" else MINIMAL_SCHEMAS[source]
    return jsonschema.Draft4Validator(schema)


def _where(path) -> str:
    return "/".join(str(p) for p in path) or "(root)"


def _undeclared_fields(obj, schema: dict, path: tuple = ()) -> list[str]:
    """Fields the structural schema does not declare: the API server would drop them silently."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or not isinstance(obj, (dict, list)):
        return []
    if isinstance(obj, list):
        items = schema.get("items") or {}
        return [p for i, v in enumerate(obj) for p in _undeclared_fields(v, items, path + (i,))]
    props = schema.get("properties")
    extra = schema.get("additionalProperties")
    out = []
    for key, value in obj.items():
        if props is not None and key in props:
            out += _undeclared_fields(value, props[key], path + (key,))
        elif isinstance(extra, dict):
            out += _undeclared_fields(value, extra, path + (key,))
        elif props is not None and not (path == () and key in ("apiVersion", "kind", "metadata", "status")):
            out.append(f"{_where(path + (key,))}: unknown field (the API server would drop it)")
    return out


@functools.cache
def _cel_program(rule: str):
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def _cel_holds(rule: str, value) -> tuple[bool, str]:
    """(does the rule hold for `self` = value, why not); an evaluation error fails the rule, as on the API server."""
    import celpy

    try:
        return bool(_cel_program(rule).evaluate({"self": celpy.json_to_cel(value)})), ""
    except celpy.CELEvalError as e:
        return False, f" ({e.args[0] if e.args else e})"


def _cel_problems(obj, schema: dict, path: tuple = ()) -> list[str]:
    """The CRD's CEL rules that `obj` breaks, walked with the schema as `_undeclared_fields` walks it."""
    out = []
    for validation in schema.get("x-kubernetes-validations") or []:
        rule = validation["rule"]
        if "oldSelf" in rule:
            continue
        holds, why = _cel_holds(rule, obj)
        if not holds:
            out.append(f"{_where(path)}: {validation.get('message') or 'failed rule ' + rule}{why}")
    if isinstance(obj, list):
        return out + [p for i, v in enumerate(obj) for p in _cel_problems(v, schema.get("items") or {}, path + (i,))]
    if isinstance(obj, dict):
        props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        for key, value in obj.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                out += _cel_problems(value, sub, path + (key,))
    return out


def _check_crd(obj: dict, crd_file: Path) -> list[str]:
    version = obj["apiVersion"].split("/")[-1]
    schema_key = ("crd", (str(crd_file), version))
    errors = [f"{_where(e.absolute_path)}: {e.message}" for e in _validator(schema_key).iter_errors(obj)]
    schema = _crd_schema(str(crd_file), version)
    if (obj["apiVersion"], obj["kind"]) in CEL_CHECKED:
        errors += _cel_problems(obj, schema)
    return errors + _undeclared_fields(obj, schema)


def _check_core(obj: dict) -> list[str] | None:
    """None when kubernetes_validate has no schema for the kind."""
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except SchemaNotFoundError:
        return None
    except kubernetes_validate.ValidationError as e:
        return [f"{_where(e.path)}: {e.message}"]
    return []


def check(obj: dict, crd_dir: Path | None = None) -> tuple[str, list[str]]:
    """(how it was checked, problems) for one object; problems non-empty = invalid or uncheckable."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in CRD_FILES:
        base = vendored_crd_dir() if crd_dir is None or key in VENDORED_ONLY else crd_dir
        crd_file = base / CRD_FILES[key]
        if not crd_file.is_file():
            return "CRD schema", [f"cannot check: CRD schema {crd_file} is missing"]
        return f"CRD schema {crd_file.name}", _check_crd(obj, crd_file)
    if key in MINIMAL_SCHEMAS:
        errors = [f"{_where(e.absolute_path)}: {e.message}" for e in _validator(("minimal", key)).iter_errors(obj)]
        return "kubetune's minimal PodGroup schema (no upstream CRD vendored)", errors
    core = _check_core(obj)
    if core is None:
        return "nothing", [f"cannot check: no schema for {key[1]} {key[0]}"]
    return f"kubernetes-validate {KUBERNETES_VERSION} strict", core


def validate_objects(objects: list[dict], crd_dir: Path | None = None) -> list[str]:
    """Every problem of every object, as `Kind/name: path: message` lines (empty = all valid)."""
    problems = []
    for obj in objects:
        label = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
        problems += [f"{label}: {p}" for p in check(obj, crd_dir)[1]]
    return problems + kueue.topology_problems(objects)
