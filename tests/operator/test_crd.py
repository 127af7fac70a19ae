"""The FineTune CRD: generated from the recipe schema, structural, and strict like the API server."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from kubetune.operator.crd import (
    PHASES,
    check_finetune,
    checked_in_path,
    crd,
    crd_yaml,
    openapi_schema,
    structural,
)
from kubetune.recipe.loader import builtin_recipes, load_recipe

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "finetune.yaml"

# The fields of apiextensions.k8s.io/v1 JSONSchemaProps kubetune may use; a node may set no other.
ALLOWED_KEYS = {
    "type", "description", "properties", "additionalProperties", "items", "required", "enum", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems", "minLength",
    "maxLength", "pattern", "nullable", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
}  # fmt: skip
UNTYPED_OK = ("x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields")


def structural_problems(node: dict, path: str = "") -> list[str]:
    """The structural-schema rules of apiextensions v1 that a generated schema could break."""
    out = [f"{path}: {k} is not allowed here" for k in node if k not in ALLOWED_KEYS]
    if "type" not in node and not any(node.get(k) for k in UNTYPED_OK):
        out.append(f"{path}: no type")
    if "properties" in node and "additionalProperties" in node:
        out.append(f"{path}: properties and additionalProperties are mutually exclusive")
    if node.get("additionalProperties") is False:
        out.append(f"{path}: additionalProperties: false is forbidden")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in node and not isinstance(node[key], bool):
            out.append(f"{path}: {key} must be a boolean in OpenAPI v3.0")
    if node.get("nullable") and "enum" in node:
        out.append(f"{path}: a nullable enum rejects null on the API server")
    for name, sub in node.get("properties", {}).items():
        out += structural_problems(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out += structural_problems(node[key], f"{path}[{key}]")
    return out


def finetune(recipe: dict | None = None, **spec) -> dict:
    body = {"recipe": recipe if recipe is not None else {"train": {"max_steps": 5}}, **spec}
    return {"apiVersion": "kubetune.io/v1alpha1", "kind": "FineTune", "metadata": {"name": "ft"}, "spec": body}


def test_checked_in_crd_is_what_the_recipe_schema_generates():
    assert checked_in_path().read_text() == crd_yaml(), "regenerate: kubetune operator crd > " + str(
        checked_in_path().relative_to(REPO)
    )


def test_cli_prints_the_crds():
    from kubetune.cli import app
    from kubetune.operator import modelserver_crd

    result = CliRunner().invoke(app, ["operator", "crd"])
    assert result.exit_code == 0, result.output
    assert list(yaml.safe_load_all(result.output)) == [crd(), modelserver_crd.crd()]


def test_crd_validates_strictly_as_a_custom_resource_definition():
    kubernetes_validate.validate(crd(), "1.35.0", strict=True)


def test_crd_schema_is_structural():
    assert structural_problems(openapi_schema()) == []


def test_structural_check_can_fail():
    bad = {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}
    assert structural_problems(bad) == [".a: anyOf is not allowed here", ".a: no type"]


def test_nullable_unions_become_nullable_or_widened_nodes():
    defs: dict = {}
    assert structural({"anyOf": [{"type": "string"}, {"type": "null"}]}, defs) == {"type": "string", "nullable": True}
    assert structural({"anyOf": [{"type": "integer"}, {"const": "auto", "type": "string"}]}, defs) == {
        "x-kubernetes-int-or-string": True
    }
    assert structural({"type": "number", "exclusiveMinimum": 0}, defs) == {
        "type": "number",
        "minimum": 0,
        "exclusiveMinimum": True,
    }
    # a null of a nullable enum is pruned (absent = the default): only safe when the default is null
    with pytest.raises(ValueError, match="default 'x'"):
        structural({"anyOf": [{"enum": ["x"], "type": "string"}, {"type": "null"}], "default": "x"}, defs)


def test_status_phase_and_printer_columns():
    version = crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert openapi_schema()["properties"]["status"]["properties"]["phase"]["enum"] == list(PHASES)
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == ["Phase", "Progress", "ETA", "Loss", "Age"]
    for column in version["additionalPrinterColumns"][:-1]:  # every path is a declared status field
        node = openapi_schema()
        for part in column["jsonPath"].strip(".").split("."):
            node = node["properties"][part]
        assert node["type"] in (column["type"], "string"), column


def test_example_finetune_validates_and_its_recipe_loads(tmp_path):
    example = yaml.safe_load(EXAMPLE.read_text())
    assert check_finetune(example) == []
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(example["spec"]["recipe"]))
    assert load_recipe(str(path)).recipe.train.max_steps == 40


@pytest.mark.parametrize("name", sorted(builtin_recipes()))
def test_every_key_of_every_shipped_recipe_is_declared(name):
    # the whole resolved recipe (every key, nulls included) is a valid spec.recipe
    recipe = load_recipe(name).recipe.model_dump(mode="json")
    assert check_finetune(finetune(recipe)) == []


def test_misspelt_recipe_key_is_rejected_like_strict_field_validation():
    bad = finetune({"train": {"max_stpes": 5}, "lora": {"r": 8}, "dat": {}})
    assert check_finetune(bad) == ['unknown field "spec.recipe.train.max_stpes"', 'unknown field "spec.recipe.dat"']


def test_wrong_types_and_values_are_rejected():
    bad = finetune({"train": {"max_steps": "many", "lr": 0}, "finetune": {"method": "qlora"}}, profile="tpu")
    problems = check_finetune(bad)
    assert "spec.recipe.train.max_steps: 'many' is not of type 'integer', 'null'" in problems
    assert any(p.startswith("spec.recipe.train.lr: 0 is less than or equal to the minimum") for p in problems)
    assert "spec.recipe.finetune.method: 'qlora' is not one of ['lora', 'full']" in problems
    assert "spec.profile: 'tpu' is not one of ['cpu', 'gaudi', 'nvidia']" in problems


def test_null_means_what_the_recipe_says():
    # nullable fields keep null (data.columns.input=null drops the column); a null enum is pruned
    recipe = {"data": {"columns": {"input": None}}, "comm": {"nccl": {"debug": None}}, "train": {"max_grad_norm": None}}
    assert check_finetune(finetune(recipe)) == []
    assert check_finetune(finetune({"train": {"lr": None}})) == []  # pruned, so the default applies


def test_profile_resources_keys_are_the_profiles():
    good = finetune({"k8s": {"profile_resources": {"gaudi": {"accelerators": 4}}}})
    assert check_finetune(good) == []
    bad = copy.deepcopy(good)
    bad["spec"]["recipe"]["k8s"]["profile_resources"] = {"tpu": {"accelerators": 4}}
    assert check_finetune(bad) == ['unknown field "spec.recipe.k8s.profile_resources.tpu"']


def test_unknown_fields_of_the_finetune_itself_are_rejected_too():
    bad = finetune(serve={"enabled": True, "replica": 2})
    assert check_finetune(bad) == ['unknown field "spec.serve.replica"']
