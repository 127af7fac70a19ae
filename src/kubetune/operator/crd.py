"""The FineTune CustomResourceDefinition (kubetune.io/v1alpha1), generated from the recipe schema.

`spec.recipe` is pydantic's JSON schema of `Recipe` made *structural* (the form the API
server requires of a CRD schema): $refs inlined, every node typed, `nullable: true` instead
of `anyOf [T, null]`, no defaults (the recipe loader applies them, so the stored object keeps
what the user wrote), `minimum` + `exclusiveMinimum: true` (OpenAPI 3.0) for pydantic's gt.

Unknown recipe keys: a structural schema may not combine `properties` with
`additionalProperties: false`. It needs neither: no node sets
`x-kubernetes-preserve-unknown-fields`, so the API server treats every undeclared key as
unknown. Under strict field validation (`kubectl apply`'s default since 1.25:
`--validate=strict`) it rejects the object with `unknown field "spec.recipe.trian"`; under
`--validate=warn|ignore` it prunes the key (and the operator's loader never sees it).
`unknown_fields` below lists those keys the way the API server does; `check_finetune`
validates a FineTune as the API server would (tests, the Helm chart's tests).

Unions a structural schema cannot express (a node has one type) are widened, and the recipe
loader, which the operator runs on create, checks them exactly: int | str becomes
`x-kubernetes-int-or-string`, any other mix (str | float, list | str) keeps any value
(`x-kubernetes-preserve-unknown-fields` on that scalar node alone).
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
from pathlib import Path
from typing import Any

import yaml

from kubetune.contracts.gate import REGISTRIES
from kubetune.k8s.finetune import API_VERSION, GROUP, KIND, PLURAL, VERSION
from kubetune.k8s.serve.settings import scalar_type, setting_options
from kubetune.recipe.schema import Recipe

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "check_finetune", "crd", "crd_yaml"]

CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILE = f"{CRD_NAME}.yaml"
PHASES = ("Pending", "Running", "Suspended", "Exporting", "Serving", "Succeeded", "Failed")
PROFILES = ("cpu", "gaudi", "nvidia")
APIS = ("pytorchjob", "trainjob")
CLAIM_POLICIES = ("Retain", "Delete")
ADAPTER_NAME_PATTERN = "^[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"  # a served name; `@` is the version's

Schema = dict[str, Any]
_DROPPED = ("title", "default", "propertyNames", "$defs")


# ------------------------------------------------------------------ pydantic -> structural


def structural(node: Schema, defs: dict[str, Schema]) -> Schema:
    """One pydantic JSON-schema node as a structural OpenAPI v3 node (recursively)."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        return structural({**target, **{k: v for k, v in node.items() if k != "$ref"}}, defs)
    if "anyOf" in node:
        return _union(node, defs)
    out: Schema = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "additionalProperties":
            if isinstance(value, dict):  # a map; `false` is what strict field validation already does
                out[key] = structural(value, defs)
        elif key == "items":
            out[key] = structural(value, defs)
        else:
            out[key] = value
    return _enum_keyed_map(node, out)


def _enum_keyed_map(node: Schema, out: Schema) -> Schema:
    """dict[Literal[...], T]: a map whose keys are an enum becomes an object with those properties
    (OpenAPI has no propertyNames, and fixed keys make a misspelt key unknown)."""
    keys = node.get("propertyNames", {}).get("enum")
    if keys and "additionalProperties" in out:
        value = out.pop("additionalProperties")
        out["properties"] = {k: copy.deepcopy(value) for k in keys}
    return out


def _union(node: Schema, defs: dict[str, Schema]) -> Schema:
    branches = [b for b in node["anyOf"] if b.get("type") != "null"]
    nullable = len(branches) < len(node["anyOf"])
    outer = {k: v for k, v in node.items() if k != "anyOf"}
    if len(branches) == 1:
        out = structural({**branches[0], **outer}, defs)
    else:
        types = {structural(b, defs).get("type") for b in branches}
        out = structural(outer, defs)
        # one type per node: int|str has Kubernetes' own marker, other mixes keep any value
        marker = "int-or-string" if types == {"integer", "string"} else "preserve-unknown-fields"
        out[f"x-kubernetes-{marker}"] = True
    if nullable:
        _make_nullable(out, node.get("default"))
    return out


def _make_nullable(out: Schema, default: Any) -> None:
    # The API server's enum check fails on null even with nullable: true, so an enum keeps its
    # nulls out: a null there is pruned like an absent key, which the loader reads as the default.
    if "enum" in out:
        if default is not None:
            raise ValueError(f"enum {out['enum']} is nullable with default {default!r}: a pruned null would change it")
        return
    out["nullable"] = True


@functools.cache
def recipe_schema() -> Schema:
    """`spec.recipe`: the whole recipe, same keys as the YAML file."""
    source = Recipe.model_json_schema()
    out = structural(source, source.get("$defs", {}))
    out["description"] = (
        "The kubetune recipe, same keys as the YAML file (`kubetune recipe reference`). "
        "k8s.namespace is the FineTune's own; spec.profile and spec.api override k8s.profile and k8s.api."
    )
    return out


# ------------------------------------------------------------------ the FineTune's own fields


def _str(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def _int(description: str, minimum: int | None = 0, **extra: Any) -> Schema:
    out: Schema = {"type": "integer", "description": description, **extra}
    if minimum is not None:
        out["minimum"] = minimum
    return out


def _num(description: str) -> Schema:
    return {"type": "number", "description": description}


def _obj(description: str, properties: dict[str, Schema], required: list[str] | None = None) -> Schema:
    out: Schema = {"type": "object", "description": description, "properties": properties}
    if required:
        out["required"] = required
    return out


def _key_ref(what: str, default_key: str) -> Schema:
    return _obj(
        f"A key of a {what} in the FineTune's namespace.",
        {"name": _str(f"The {what}'s name."), "key": _str(f"The key (default {default_key}).")},
        ["name"],
    )


def serve_schema() -> Schema:
    """`spec.serve`: `enabled`, then each ServeSettings field that names a spec key."""
    properties: dict[str, Schema] = {
        "enabled": {"type": "boolean", "description": "Export and serve after training (default false)."}
    }
    for f, option in setting_options():
        if option.spec_key is None:
            continue
        if scalar_type(f) is int:
            properties[option.spec_key] = _int(option.spec_help, minimum=option.minimum)
        else:
            choices = {"enum": list(option.choices)} if option.choices else {}
            properties[option.spec_key] = _str(option.spec_help, **choices)
    properties["server"] = _str(
        "A ModelServer in this namespace: export the LoRA adapter (not merged) into it and serve it there, "
        "instead of a Deployment of this run's own."
    )
    properties["adapterName"] = _str(
        "The adapter's name on the server (default: the FineTune's name); versions are NAME@v1, NAME@v2, ...",
        pattern=ADAPTER_NAME_PATTERN,
    )
    what = "Serve the trained model when training succeeds: the objects of `kubetune k8s render-serve`."
    return _obj(what, properties)


def export_schema() -> Schema:
    """`spec.export`: the merged export, and registering the model in a model registry."""
    register = (
        "Register the exported model (the merged model with merged or when served alone, else the adapter; "
        "a ModelServer's adapter with serve.server) with its lineage, after the eval gate passed: mlflow "
        "(MLFLOW_TRACKING_URI from the recipe's monitor.tracking_env_from) or kubeflow (registryUrl)."
    )
    return _obj(
        "Merged export after training (always done when serving), and the model registry.",
        {
            "merged": {"type": "boolean", "description": "Write the merged model (default false)."},
            "register": _str(register, enum=list(REGISTRIES)),
            "registeredName": _str("The registered model's name (default: the FineTune's, or serve.adapterName)."),
            "registryUrl": _str("register kubeflow: the Model Registry's REST address."),
        },
    )


def spec_schema() -> Schema:
    spec = _obj(
        "What to fine-tune and how to run and serve it.",
        {
            "recipe": recipe_schema(),
            "recipeRef": _key_ref("ConfigMap holding a recipe YAML", "recipe.yaml"),
            "profile": _str("cpu | gaudi | nvidia (default: the recipe's k8s.profile).", enum=list(PROFILES)),
            "api": _str("pytorchjob | trainjob (default: the recipe's k8s.api).", enum=list(APIS)),
            "hfTokenSecretRef": _key_ref("Secret holding a Hugging Face token (gated models)", "HF_TOKEN"),
            "serve": serve_schema(),
            "export": export_schema(),
            "suspend": {
                "type": "boolean",
                "description": "true deletes the training job and its pods and keeps the volume; "
                "false starts them again, resuming from the last checkpoint.",
            },
            "ttlSecondsAfterFinished": _int("Delete the finished training job (and its pods) this long after it ends."),
            "volumeClaimRetention": _str(
                "Retain (default): the volume claim outlives the FineTune; Delete: it goes with it.",
                enum=list(CLAIM_POLICIES),
            ),
        },
    )
    spec["x-kubernetes-validations"] = [
        {"rule": "has(self.recipe) != has(self.recipeRef)", "message": "set exactly one of spec.recipe, spec.recipeRef"}
    ]
    return spec


def condition_schema() -> Schema:
    return _obj(
        "One observation (metav1.Condition's fields).",
        {
            "type": _str("Valid, Training, Suspended, Exported, Serving, Ready, Restarted, RecipeChange, ..."),
            "status": _str("True | False | Unknown.", enum=["True", "False", "Unknown"]),
            "reason": _str("One CamelCase word."),
            "message": _str("What happened and what to do; one line per problem."),
            "lastTransitionTime": _str("When status last changed.", format="date-time"),
            "observedGeneration": _int("The spec generation it describes."),
        },
        ["type", "status"],
    )


def status_schema() -> Schema:
    condition = condition_schema()
    progress = _obj(
        "Rank 0's progress (the job's log line or its metrics).",
        {
            "step": _int("Optimizer steps done."),
            "totalSteps": _int("Planned optimizer steps."),
            "percent": _int("step / totalSteps in percent."),
            "etaSeconds": _int("Estimated seconds left."),
            "eta": _str("etaSeconds for people (e.g. 1h05m)."),
            "loss": _num("Training loss of the last logged step."),
            "evalLoss": _num("Last evaluation loss."),
            "tokensPerSecond": _num("Training throughput."),
        },
    )
    ref = {"apiVersion": _str("API version."), "kind": _str("Kind."), "name": _str("Name.")}
    return _obj(
        "What the operator observed.",
        {
            "phase": _str(" | ".join(PHASES) + ".", enum=list(PHASES)),
            "conditions": {
                "type": "array",
                "description": "Observations, with reasons a person can act on.",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "progress": progress,
            "jobRef": _obj("The training job.", ref),
            "exportJobRef": _obj("The merged-export Job.", ref),
            "artifacts": _obj(
                "Paths on the volume claim (mounted at /data).",
                {
                    "claim": _str("The volume claim."),
                    "runDir": _str("The run directory."),
                    "adapter": _str("The LoRA adapter (or full model) directory."),
                    "merged": _str("The merged model directory."),
                },
            ),
            "endpoint": _str("The served OpenAI-compatible base URL."),
            "adapter": _obj(
                "spec.serve.server: the adapter as the ModelServer serves it.",
                {
                    "server": _str("The ModelServer."),
                    "name": _str("The adapter (its alias)."),
                    "version": _str("This FineTune's version, vN."),
                    "servedName": _str("NAME@vN: the model name requests use (the alias NAME routes by weight)."),
                    "path": _str("Its directory on the server's adapter volume."),
                    "registered": {"type": "boolean", "description": "Exported and in the server's registry."},
                },
            ),
            "gate": _obj(
                "The eval gate's verdict (recipe eval.gate), read from the export Job: served only when passed.",
                {
                    "metric": _str("The gated metric (perplexity, <task>/<metric>, ...)."),
                    "passed": {"type": "boolean", "description": "Whether the tuned model passed."},
                    "base": _num("The base model's value."),
                    "tuned": _num("The tuned model's value."),
                    "threshold": _num("compare=threshold: the value to reach."),
                    "rule": _str("The rule, in words (e.g. tuned >= base - 0.01)."),
                    "reason": _str("Why it failed without numbers (a missing value)."),
                },
            ),
            "registered": _obj(
                "spec.export.register: the model as the registry registered it, read from the export Job.",
                {
                    "registry": _str("mlflow | kubeflow."),
                    "name": _str("The registered model."),
                    "version": _str("Its version."),
                    "uri": _str("Where the registry says the weights are (MLflow: the version's source)."),
                },
            ),
            "lmEval": {
                "type": "object",
                "description": "lm-eval's results (recipe eval.tasks), read from the export Job: task -> metric -> "
                "{base, tuned}.",
                "additionalProperties": {
                    "type": "object",
                    "additionalProperties": _obj(
                        "One metric of the base and the tuned model.",
                        {"base": _num("The base model's value."), "tuned": _num("The tuned model's value.")},
                    ),
                },
            },
            "restarts": _int("Training pod restarts seen."),
            "observedGeneration": _int("The spec generation last acted on."),
        },
    )


def printer_columns() -> list[Schema]:
    return [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Progress", "type": "integer", "jsonPath": ".status.progress.percent", "description": "Percent"},
        {"name": "ETA", "type": "string", "jsonPath": ".status.progress.eta"},
        {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd() -> Schema:
    """The CustomResourceDefinition object."""
    schema = _obj(
        "A fine-tune from recipe to served model, owned by kubetune's operator.",
        {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        ["spec"],
    )
    version = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "subresources": {"status": {}},
        "additionalPrinterColumns": printer_columns(),
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "kubetune"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": "finetune", "shortNames": ["ft"]},
            "versions": [version],
        },
    }


HEADER = "# Generated by `kubetune operator crd` from kubetune's recipe schema; do not edit (a test compares).\n"


def crd_yaml() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=120)


def checked_in_path() -> Path:
    return Path(str(importlib.resources.files("kubetune.operator") / "crds" / CRD_FILE))


# ------------------------------------------------------------------ checking a FineTune


def openapi_schema() -> Schema:
    schema: Schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def unknown_fields(obj: Any, schema: Schema, path: str = "") -> list[str]:
    """Keys the schema does not declare, as the API server's strict field validation names them."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in unknown_fields(v, schema.get("items", {}), f"{path}[{i}]")]
    if not isinstance(obj, dict) or schema.get("type") != "object":
        return []
    props, extra = schema.get("properties"), schema.get("additionalProperties")
    out = []
    for key, value in obj.items():
        where = f"{path}.{key}" if path else key
        if props is not None and key in props:
            out += unknown_fields(value, props[key], where)
        elif isinstance(extra, dict):
            out += unknown_fields(value, extra, where)
        elif props is not None:
            out.append(where)
    return out


def draft4(node: Any) -> Any:
    """An OpenAPI v3 (structural) schema as JSON Schema draft 4, for jsonschema."""
    if isinstance(node, list):
        return [draft4(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: draft4(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable") and "type" in out:
        out["type"] = [*([out["type"]] if isinstance(out["type"], str) else out["type"]), "null"]
    return out


def _drop_pruned_nulls(obj: Any, schema: Schema) -> Any:
    """The API server drops null values of fields that are not nullable before validating."""
    if isinstance(obj, list):
        return [_drop_pruned_nulls(v, schema.get("items", {})) for v in obj]
    if not isinstance(obj, dict):
        return obj
    props, extra = schema.get("properties", {}), schema.get("additionalProperties")
    out = {}
    for key, value in obj.items():
        sub = props.get(key, extra if isinstance(extra, dict) else {})
        if value is None and not sub.get("nullable") and sub:
            continue
        out[key] = _drop_pruned_nulls(value, sub)
    return out


def check_finetune(obj: dict[str, Any]) -> list[str]:
    """Problems the API server would report for this FineTune under strict field validation
    (CEL rules are not evaluated here), one line each; empty = it would be accepted."""
    return schema_problems(obj, openapi_schema())


def schema_problems(obj: dict[str, Any], schema: Schema) -> list[str]:
    """Problems the API server would report for `obj` under strict field validation against this
    structural schema (CEL rules are not evaluated here), one line each."""
    import jsonschema

    problems = [f'unknown field "{p}"' for p in unknown_fields(obj, schema)]
    pruned = _drop_pruned_nulls(obj, schema)
    validator = jsonschema.Draft4Validator(draft4(schema))
    for error in sorted(validator.iter_errors(pruned), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(p) for p in error.absolute_path) or "(root)"
        problems.append(f"{where}: {error.message}")
    return problems
