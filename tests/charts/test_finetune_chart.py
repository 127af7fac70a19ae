"""The kubetune-finetune chart: one FineTune the API server accepts, whose recipe kubetune loads and renders.

Each FineTune the chart renders is checked three ways: against the FineTune CRD's own openAPIV3Schema as the
API server checks it (kubetune.operator.crd.check_finetune: jsonschema plus strict field validation), through
the operator's own derivation of the recipe (kubetune.operator.plan.load_recipe_for: the CLI's recipe loader and
render checks), and through `kubetune k8s render --check` (every job object validated offline).
examples/medical_meadow_values.yaml must be seed 002's job: the shipped seed recipe, key for key.
"""

from __future__ import annotations

import helm_python
import pytest
import yaml

from kubetune.errors import RecipeError
from kubetune.k8s.render import render as render_job
from kubetune.k8s.validate import validate_objects
from kubetune.operator.crd import check_finetune, spec_schema
from kubetune.recipe.loader import builtin_recipes, recipe_to_yaml
from kubetune.recipe.schema import Recipe

from ..k8s.conftest import run_cli
from .helm import FINETUNE_CHART, chart, objects

EXAMPLE = FINETUNE_CHART / "examples" / "medical_meadow_values.yaml"
SEED = builtin_recipes()["llama2-7b-medical-flashcards"]


def example_values() -> dict:
    # as `helm install -f` reads the file: Go's YAML reader (quoted "on" stays a string, 2.0e-5 a number)
    return helm_python.values_from_yaml(EXAMPLE.read_text())


EVERY_VALUE = {
    "name": "every-value",
    "recipe": {"train": {"max_steps": 5}},
    "profile": "nvidia",
    "api": "trainjob",
    "hfTokenSecretRef": {"name": "hf-token", "key": "token"},
    "serve": {
        "enabled": True,
        "engine": "vllm",
        "replicas": 2,
        "minReplicas": 2,
        "maxReplicas": 6,
        "autoscale": "cpu",
        "image": "registry.example.com/vllm:1",
        "ingressHost": "llm.example.com",
    },
    "export": {"merged": True},
    "suspend": True,
    "ttlSecondsAfterFinished": 0,
    "volumeClaimRetention": "Delete",
    "labels": {"team": "nlp"},
    "annotations": {"example.com/owner": "nlp"},
}
CASES = {"defaults": {}, "medical example": "example", "every value": EVERY_VALUE}


def finetune(values: dict, name: str = "medical", namespace: str = "fine-tuning") -> dict:
    (obj,) = objects(FINETUNE_CHART, values, name=name, namespace=namespace)
    assert (obj["apiVersion"], obj["kind"]) == ("kubetune.io/v1alpha1", "FineTune")
    return obj


def values_of(case: str) -> dict:
    return example_values() if CASES[case] == "example" else CASES[case]


def recipe_of(obj: dict, data: dict | None = None) -> Recipe:
    """The recipe the operator trains for this FineTune, derived by the operator's own code: spec.recipe (or
    `data`) with spec.profile / spec.api over the recipe's, named and placed by the FineTune, loaded by the
    CLI's recipe loader and checked as `kubetune k8s render` checks it."""
    from kubetune.operator.plan import FineTuneSpec, load_recipe_for

    spec = FineTuneSpec.from_dict(obj["spec"])
    meta = obj["metadata"]
    return load_recipe_for(meta["name"], meta["namespace"], spec.recipe if data is None else data, spec)


def test_lint_finds_nothing_for_the_defaults_and_the_example():
    for values in ({}, example_values(), EVERY_VALUE):
        report = helm_python.lint(str(FINETUNE_CHART), values, strict=True, namespace="fine-tuning")
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == []  # no warning either (strict)


@pytest.mark.parametrize("case", CASES)
def test_the_finetune_is_one_the_api_server_accepts(case):
    obj = finetune(values_of(case))
    assert check_finetune(obj) == []
    # the CRD's one CEL rule, which check_finetune does not evaluate
    assert ("recipe" in obj["spec"]) != ("recipeRef" in obj["spec"])


@pytest.mark.parametrize("case", CASES)
def test_the_recipe_inside_loads_and_renders_a_valid_job(case):
    obj = finetune(values_of(case))
    rendered = render_job(recipe_of(obj))
    assert validate_objects(rendered.objects) == []
    assert rendered.names.job == obj["metadata"]["name"]
    assert {o["metadata"].get("namespace") for o in rendered.objects} - {None} == {"fine-tuning"}


def test_the_example_renders_with_kubetune_k8s_render(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(recipe_of(finetune(example_values()))))
    result = run_cli("k8s", "render", str(path), "--check")
    assert result.code == 0, result.err
    assert "all valid" in result.err


def test_the_example_is_seed_002s_recipe_key_for_key():
    obj = finetune(example_values())
    seed = yaml.safe_load(SEED.read_text())
    assert recipe_of(obj).model_dump() == recipe_of(obj, seed).model_dump()


def test_the_example_is_seed_002s_job():
    obj = finetune(example_values())
    recipe = recipe_of(obj)
    assert recipe.model.name_or_path == "meta-llama/Llama-2-7b-chat-hf"
    assert recipe.data.train == "medalpaca/medical_meadow_medical_flashcards"
    assert (recipe.train.epochs, recipe.train.lr, recipe.train.precision) == (3, 2e-5, "bf16")
    assert (recipe.finetune.method, recipe.lora.r, recipe.lora.alpha) == ("lora", 8, 16)
    assert obj["spec"]["hfTokenSecretRef"]["name"]  # Llama 2 is gated
    job = render_job(recipe).job
    assert job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert sum(s["replicas"] for s in specs.values()) == 4
    for spec in specs.values():
        (container,) = spec["template"]["spec"]["containers"]
        resources = container["resources"]
        # Guaranteed QoS: requests equal limits for cpu and memory, in every container
        assert resources["requests"] == resources["limits"] == {"cpu": "200", "memory": "226Gi"}


def test_the_default_trains_the_recipe_schemas_defaults():
    # what values.yaml and the README promise for `recipe: {}`
    obj = finetune({})
    assert obj["spec"]["recipe"] == {}
    recipe = recipe_of(obj)
    assert (recipe.model.name_or_path, recipe.data.train) == (
        "smollm2-135m-instruct",
        "builtin:medical_flashcards_sample",
    )
    assert (recipe.finetune.method, recipe.train.epochs, recipe.k8s.profile, recipe.k8s.replicas) == (
        "lora",
        1,
        "cpu",
        2,
    )


def test_every_value_reaches_the_spec():
    spec = finetune(EVERY_VALUE)["spec"]
    for field in ("recipe", "profile", "api", "hfTokenSecretRef", "serve", "export", "suspend"):
        assert spec[field] == EVERY_VALUE[field], field
    assert (spec["ttlSecondsAfterFinished"], spec["volumeClaimRetention"]) == (0, "Delete")


def test_every_spec_field_of_the_crd_is_a_value():
    # a new FineTune spec field must reach the chart too: this fails until values.yaml (and the template) have it
    chart_values = helm_python.Chart.load(str(FINETUNE_CHART)).values
    fields = spec_schema()["properties"]
    assert set(fields) <= set(chart_values)
    for section in ("serve", "export", "recipeRef", "hfTokenSecretRef"):
        assert set(fields[section]["properties"]) == set(chart_values[section]), section


def test_empty_values_are_left_to_the_operator():
    spec = finetune({})["spec"]
    assert "hfTokenSecretRef" not in spec and "ttlSecondsAfterFinished" not in spec
    assert "profile" not in spec and "api" not in spec  # the recipe's k8s.profile / k8s.api decide
    assert set(spec["serve"]) == {"enabled", "engine", "replicas", "autoscale"}  # no null, no ""


def test_a_recipe_from_a_configmap():
    spec = finetune({"recipeRef": {"name": "my-recipe"}})["spec"]
    assert spec["recipeRef"] == {"name": "my-recipe", "key": "recipe.yaml"}
    assert "recipe" not in spec
    assert check_finetune(finetune({"recipeRef": {"name": "my-recipe"}})) == []


def test_two_recipes_are_refused():
    with pytest.raises(helm_python.HelmRenderError, match="not both"):
        finetune({"recipe": {"train": {"epochs": 1}}, "recipeRef": {"name": "my-recipe"}})


def test_a_misspelt_recipe_key_is_refused_by_the_api_server_and_the_operator():
    obj = finetune({"recipe": {"train": {"epoch": 3}}})
    assert check_finetune(obj) == ['unknown field "spec.recipe.train.epoch"']
    with pytest.raises(RecipeError, match=r"`train\.epoch`"):
        recipe_of(obj)


def test_a_misspelt_value_is_refused_before_anything_is_rendered():
    # a top-level typo would otherwise be ignored and the FineTune would train the default recipe
    with pytest.raises(helm_python.HelmValuesError, match="Recipe"):
        finetune({"Recipe": {"train": {"epochs": 3}}})


def test_the_values_schema_allows_what_the_crd_allows():
    # values.schema.json repeats the CRD's enums and bounds so that `helm install` refuses early: held equal here
    values, fields = chart(FINETUNE_CHART).schema["properties"], spec_schema()["properties"]
    for key in ("profile", "api"):  # "" leaves it to the recipe
        assert values[key]["enum"] == ["", *fields[key]["enum"]], key
    assert values["volumeClaimRetention"]["enum"] == fields["volumeClaimRetention"]["enum"]
    for key in ("engine", "autoscale"):
        assert values["serve"]["properties"][key]["enum"] == fields["serve"]["properties"][key]["enum"], key
    for key in ("replicas", "minReplicas", "maxReplicas"):
        assert values["serve"]["properties"][key]["minimum"] == fields["serve"]["properties"][key]["minimum"], key
