"""The kubetune-finetune chart: one FineTune the API server accepts, whose recipe kubetune loads and renders.

Each FineTune the chart renders is checked three ways: against the FineTune CRD's own openAPIV3Schema as the
API server checks it (kubetune.operator.crd.check_finetune: jsonschema plus strict field validation), through
the operator's own derivation of the recipe (kubetune.operator.plan.load_recipe_for: the CLI's recipe loader and
render checks), and through `kubetune k8s render --check` (every job object validated offline).
examples/medical_meadow_values.yaml must be seed 002's job: the shipped seed recipe, key for key. Seed 002's own
values file (fixtures/seed002_medical_meadow_values.yaml, Intel's huggingface-llm layout) must install and mean the
recipe `kubetune recipe from-helm-values` prints for it.
"""

from __future__ import annotations

import re
from pathlib import Path

import helm_python
import pytest
import yaml

from kubetune.errors import RecipeError
from kubetune.k8s.render import render as render_job
from kubetune.k8s.validate import validate_objects
from kubetune.operator.crd import check_finetune, spec_schema
from kubetune.recipe.loader import builtin_recipes, recipe_to_yaml
from kubetune.recipe.schema import Recipe
from tests.kit.cli import run_cli_redirected

from ..k8s.conftest import kube  # noqa: F401 (the emulated API server, a fixture)
from .helm import FINETUNE_CHART, chart, installed, objects

EXAMPLE = FINETUNE_CHART / "examples" / "medical_meadow_values.yaml"
SEED_VALUES = Path(__file__).parent / "fixtures" / "seed002_medical_meadow_values.yaml"
SEED = builtin_recipes()["llama2-7b-medical-flashcards"]


def example_values() -> dict:
    # as `helm install -f` reads the file: Go's YAML reader (quoted "on" stays a string, 2.0e-5 a number)
    return helm_python.values_from_yaml(EXAMPLE.read_text())


def seed_values() -> dict:
    return helm_python.values_from_yaml(SEED_VALUES.read_text())


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
        "image": {"repository": "registry.example.com/vllm", "tag": "1", "digest": "sha256:" + "ab" * 32},
        "ingressHost": "llm.example.com",
    },
    "export": {
        "merged": True,
        "register": "kubeflow",
        "registeredName": "medical-llama",
        "registryUrl": "https://model-registry-service.kubeflow.svc:8443",
    },
    "suspend": True,
    "ttlSecondsAfterFinished": 0,
    "volumeClaimRetention": "Delete",
    "labels": {"team": "nlp"},
    "annotations": {"example.com/owner": "nlp"},
    "test": {"image": {"repository": "registry.example.com/kubectl", "tag": "v1.33.0", "digest": ""}, "timeout": "5m"},
}
CASES = {"defaults": {}, "medical example": "example", "seed 002's values": "seed", "every value": EVERY_VALUE}


def finetune(values: dict, name: str = "medical", namespace: str = "fine-tuning") -> dict:
    (obj,) = [o for o in objects(FINETUNE_CHART, values, name=name, namespace=namespace) if o["kind"] == "FineTune"]
    assert obj["apiVersion"] == "kubetune.io/v1alpha1"
    return obj


def values_of(case: str) -> dict:
    files = {"example": example_values, "seed": seed_values}
    value = CASES[case]
    return files[value]() if isinstance(value, str) else value


def recipe_of(obj: dict, data: dict | None = None) -> Recipe:
    """The recipe the operator trains for this FineTune, derived by the operator's own code: spec.recipe (or
    `data`) with spec.profile / spec.api over the recipe's, named and placed by the FineTune, loaded by the
    CLI's recipe loader and checked as `kubetune k8s render` checks it."""
    from kubetune.operator.plan import FineTuneSpec, load_recipe_for

    spec = FineTuneSpec.from_dict(obj["spec"])
    meta = obj["metadata"]
    return load_recipe_for(meta["name"], meta["namespace"], spec.recipe if data is None else data, spec)


def test_lint_finds_nothing_for_the_defaults_the_example_and_seed_002s_values():
    for values in ({}, example_values(), seed_values(), EVERY_VALUE):
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


def test_the_example_renders_with_kubetune_k8s_render(tmp_path, monkeypatch):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(recipe_of(finetune(example_values()))))
    monkeypatch.setenv("HF_TOKEN", "hf_a_made_up_token_for_the_check")  # Llama 2 is gated: --check wants a token
    result = run_cli_redirected("k8s", "render", str(path), "--check")
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
    for field in ("recipe", "profile", "api", "hfTokenSecretRef", "export", "suspend"):
        assert spec[field] == EVERY_VALUE[field], field
    image = EVERY_VALUE["serve"]["image"]
    assert spec["serve"] == EVERY_VALUE["serve"] | {"image": f"{image['repository']}:1@{image['digest']}"}
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
    assert spec["export"] == {"merged": False}  # no registry unless export.register names one
    assert "hfTokenSecretRef" not in spec and "ttlSecondsAfterFinished" not in spec
    assert "profile" not in spec and "api" not in spec  # the recipe's k8s.profile / k8s.api decide
    assert set(spec["serve"]) == {"enabled", "replicas", "autoscale"}  # no null, no "" (engine: by the profile)


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
    serve_values, serve_fields = values["serve"]["properties"], fields["serve"]["properties"]
    assert serve_values["engine"]["enum"] == ["", *serve_fields["engine"]["enum"]]  # "": the profile's engine
    assert serve_values["autoscale"]["enum"] == serve_fields["autoscale"]["enum"]
    register = fields["export"]["properties"]["register"]["enum"]
    assert values["export"]["properties"]["register"]["enum"] == ["", *register]  # "": no registry
    for key in ("replicas", "minReplicas", "maxReplicas"):
        assert values["serve"]["properties"][key]["minimum"] == fields["serve"]["properties"][key]["minimum"], key


# --- seed 002's values layout (Intel's huggingface-llm chart) as an alias of `recipe:` -----------------------

# Every key of the layout that maps to a recipe key, with a value of its own (the fixture covers the rest).
EVERY_ALIAS = {
    "image": {"pullPolicy": "Always"},
    "distributed": {
        "workers": 2,
        "doEval": False,
        "train": {
            "modelName": "meta-llama/Llama-2-7b-hf",
            "dataFile": "/data/flashcards.jsonl",
            "datasetConcatenation": False,
            "promptTemplate": "Q: {input}\nA: ",
            "perDeviceBatchSize": 2,
            "numEpochs": 1.5,
            "maxSteps": 40,
            "gradientAccumulationSteps": 4,
            "learningRate": 1e-4,
            "loggingSteps": 5,
            "saveTotalLimit": 3,
            "saveStrategy": "no",
            "useLora": False,
            "lora": {"r": 16, "alpha": 32},
            "bf16": False,
            "instructionColumnName": "question",
            "inputColumnName": "context",
            "outputColumnName": "answer",
        },
        "eval": {"perDeviceBatchSize": 4},
    },
    "envVars": {"httpProxy": "http://proxy:3128", "noProxy": ".svc,10.0.0.0/8"},
    "resources": {
        "cpuLimit": "7500m",
        "memoryLimit": "128Gi",  # a full fine-tune of 7B parameters in fp32: render refuses a pod below its estimate
        "nodeSelectorLabel": "pool",
        "nodeSelectorValue": "xeon",
    },
    "securityContext": {"runAsUser": 2000},
    "storage": {"storageClassName": "nfs-client", "resources": "10Gi"},
}


def from_helm_values(tmp_path: Path, values: dict) -> tuple[int, str, str]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = run_cli_redirected("recipe", "from-helm-values", str(path))
    return result.code, result.out, result.err


@pytest.mark.parametrize("case", ["seed 002's values", "every alias", "the example (recipe:)"])
def test_the_chart_and_from_helm_values_map_the_layout_alike(tmp_path, case):
    # the files as written (PyYAML must read the seed's `2e-5` as Helm does: a number)
    path = {"seed 002's values": SEED_VALUES, "the example (recipe:)": EXAMPLE}.get(case, tmp_path / "values.yaml")
    if case == "every alias":
        path.write_text(yaml.safe_dump(EVERY_ALIAS))
    result = run_cli_redirected("recipe", "from-helm-values", str(path))
    assert result.code == 0, result.err
    values = helm_python.values_from_yaml(path.read_text())
    printed = yaml.safe_load(result.out)
    if "output_dir" not in values.get("recipe", {}):  # the FineTune's name places its run; the file's, here
        assert printed.pop("output_dir") == f"/data/runs/{path.stem.replace('_', '-')}"
    assert finetune(values)["spec"]["recipe"] == printed
    recipe_of(finetune(values))  # a recipe the operator trains, checked as `kubetune k8s render` checks it


def test_seed_002s_values_mean_seed_002s_job():
    obj = finetune(seed_values())
    assert check_finetune(obj) == []
    recipe = recipe_of(obj)
    assert recipe.model.name_or_path == "meta-llama/Llama-2-7b-chat-hf"
    assert recipe.data.train == "medalpaca/medical_meadow_medical_flashcards"
    assert (recipe.train.epochs, recipe.train.lr, recipe.train.precision) == (3, 2e-5, "bf16")
    assert (recipe.finetune.method, recipe.lora.r, recipe.lora.alpha) == ("lora", 8, 16)
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert recipe.data.template == "alpaca"  # the seed's two prompts are Alpaca's preamble
    assert (recipe.k8s.storage.storage_class, recipe.k8s.storage.size) == ("nfs-client", "50Gi")
    specs = render_job(recipe).job["spec"]["pytorchReplicaSpecs"]
    assert list(specs) == ["Worker"] and specs["Worker"]["replicas"] == 4  # the seed's 4 Workers (elastic)
    (container,) = specs["Worker"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == container["resources"]["limits"] == {"cpu": "200", "memory": "226Gi"}


def test_the_seeds_token_becomes_a_secret_the_finetune_reads():
    by_kind = {o["kind"]: o for o in installed(objects(FINETUNE_CHART, seed_values(), name="medical", namespace="ft"))}
    secret, ref = by_kind["Secret"], by_kind["FineTune"]["spec"]["hfTokenSecretRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "HF_TOKEN"}
    assert secret["data"]["HF_TOKEN"] == seed_values()["secret"]["encodedToken"]
    notes = chart(FINETUNE_CHART).render(seed_values(), name="medical", namespace="ft")[
        "kubetune-finetune/templates/NOTES.txt"
    ]
    assert "WARNING: the Hugging Face token" in notes and "hfTokenSecretRef.name=hf-token" in notes
    assert (
        "WARNING"
        not in chart(FINETUNE_CHART).render(example_values(), name="m", namespace="ft")[
            "kubetune-finetune/templates/NOTES.txt"
        ]
    )


def test_notes_list_what_each_key_became_as_from_helm_values_does():
    from kubetune.recipe.helm_values import map_values

    notes = chart(FINETUNE_CHART).render(seed_values(), name="m", namespace="ft")[
        "kubetune-finetune/templates/NOTES.txt"
    ]
    mapping = map_values(seed_values())
    listed = re.findall(r"^  (\S+) -> recipe\.(\S+)$", notes, re.M)
    assert listed == mapping.mapped and ("distributed.workers", "k8s.replicas") in listed
    assert re.findall(r"^  (\S+): (.+)$", notes.split("Not used")[1].split("WARNING")[0], re.M) == mapping.unused


# Seed 002's section 4.2: the values snippet names a base model and a dataset, nothing else; Intel's chart fills
# in the rest (4 workers, Alpaca's prompts, ...).
SNIPPET = {
    "distributed": {
        "modelNameOrPath": "meta-llama/Llama-2-7b-hf",
        "train": {"datasetName": "medalpaca/medical_meadow_medical_flashcards"},
    }
}


def test_seed_002s_snippet_on_a_base_model_trains_as_written():
    # a base model has no chat template: data.template=auto prompts it as Intel's chart does (Alpaca's prompt)
    recipe = recipe_of(finetune(SNIPPET))  # the operator's own derivation and checks
    assert (recipe.model.name_or_path, recipe.data.template) == ("meta-llama/Llama-2-7b-hf", "auto")
    rendered = render_job(recipe)
    assert validate_objects(rendered.objects) == []
    assert "data.template=auto: alpaca for meta-llama/Llama-2-7b-hf" in " ".join(rendered.notes)


def notes_of(values: dict) -> str:
    return chart(FINETUNE_CHART).render(values, name="medical", namespace="ft")["kubetune-finetune/templates/NOTES.txt"]


def test_notes_and_from_helm_values_list_the_seed_keys_left_unset(tmp_path):
    notes = notes_of(SNIPPET)
    listed = re.findall(r"^  (\S+) -> recipe\.(\S+) = (.+) \(Intel's chart: (.+)\)$", notes, re.M)
    assert ("distributed.workers", "k8s.replicas", "2", "4") in listed  # the job gets 2 workers, not the seed's 4
    assert ("distributed.train.promptWithInput", "data.template", "auto", "alpaca") in listed
    assert not any(key in ("distributed.modelNameOrPath", "distributed.train.datasetName") for key, *_ in listed)
    code, out, err = from_helm_values(tmp_path, SNIPPET)
    assert code == 0, err
    assert re.findall(r"^#   (\S+) -> (\S+) = (.+) \(Intel's chart: (.+)\)$", out, re.M) == listed
    # a key the values set, or a recipe key `recipe:` sets, is not listed; nor anything without the layout
    with_workers = {**SNIPPET, "recipe": {"k8s": {"replicas": 4}}}
    notes = notes_of(with_workers)
    assert "distributed.workers ->" not in notes and "Intel's chart" in notes
    assert "Intel's chart" not in notes_of({})


@pytest.mark.parametrize(
    "values,release,name",
    [
        (SNIPPET, None, "values"),  # the file's name: values.yaml
        (SNIPPET, "medical", "medical"),  # `helm install medical`
        ({**SNIPPET, "name": "flashcards"}, "medical", "flashcards"),  # the chart's `name` wins, as in the chart
    ],
)
def test_from_helm_values_names_the_job_as_the_chart_does(tmp_path, values, release, name):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = run_cli_redirected("recipe", "from-helm-values", str(path), *(["--release", release] if release else []))
    assert result.code == 0, result.err
    recipe = yaml.safe_load(result.out)
    assert recipe["output_dir"] == f"/data/runs/{name}"
    job = render_job(Recipe.model_validate(recipe)).job
    assert job["metadata"]["name"] == name  # not `default`
    if release:  # the FineTune's name is the same
        assert finetune(values, name=release)["metadata"]["name"] == name


REFUSALS = {
    "a value kubetune cannot do": {"distributed": {"train": {"ddpBackend": "nccl"}}},
    "requests unlike limits": {"resources": {"cpuRequest": 100, "cpuLimit": 200}},
    "the alias and recipe: for one key": {"distributed": {"workers": 2}, "recipe": {"k8s": {"replicas": 3}}},
    "a key with no place in a FineTune": {"securityContext": {"fsGroup": 1000}},
    "two tokens": {"secret": {"encodedToken": "aGY="}, "hfTokenSecretRef": {"name": "hf-token"}},
    "a token not in base64": {"secret": {"encodedToken": "hf_abc!"}},
    "a node selector value without its label": {"resources": {"nodeSelectorValue": "xeon"}},
    "noCuda and a GPU profile": {"distributed": {"train": {"noCuda": True}}, "profile": "nvidia"},
    "the layout and a recipe from a ConfigMap": {"distributed": {"workers": 2}, "recipeRef": {"name": "my-recipe"}},
}


@pytest.mark.parametrize("case", REFUSALS)
def test_both_readers_refuse_alike_with_the_key_named(tmp_path, case):
    code, _, err = from_helm_values(tmp_path, REFUSALS[case])
    assert code == 2
    (line,) = err.strip().splitlines()
    message = line.removeprefix("kubetune: error: ")
    with pytest.raises(helm_python.HelmRenderError) as refused:
        finetune(REFUSALS[case])
    assert str(refused.value).endswith(message)  # Helm's "execution error at (...): " then the same words


def test_a_key_outside_the_layout_is_refused_by_name(tmp_path):
    values = {"distributed": {"train": {"useIpx": True}}}
    with pytest.raises(helm_python.HelmValuesError, match="additional properties 'useIpx' not allowed"):
        finetune(values)
    code, _, err = from_helm_values(tmp_path, values)
    assert code == 2 and "distributed.train.useIpx: not a key of Intel's huggingface-llm layout" in err


def test_the_charts_table_and_schema_are_the_python_modules():
    # the chart reads files/helm-values-aliases.json and values.schema.json; kubetune.recipe.helm_values writes them
    from kubetune.recipe.helm_values import chart_files

    for path, text in chart_files(FINETUNE_CHART).items():
        assert path.read_text() == text, (
            f"{path} drifted: .venv/bin/python -m kubetune.recipe.helm_values {FINETUNE_CHART}"
        )


def test_from_helm_values_knows_the_charts_own_keys():
    from kubetune.recipe.helm_values import CHART_VALUES

    assert set(CHART_VALUES) - {"global"} == set(chart(FINETUNE_CHART).values)


# --- Helm conventions --------------------------------------------------------------------------------------


def test_every_object_is_named_after_the_release_and_carries_the_standard_labels():
    one, two = (objects(FINETUNE_CHART, seed_values(), name=n, namespace="ft") for n in ("alpha", "beta"))
    assert {o["metadata"]["name"] for o in one}.isdisjoint({o["metadata"]["name"] for o in two})
    for obj in one:
        assert obj["metadata"]["name"].startswith("alpha"), obj["metadata"]["name"]
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "alpha"
        assert labels["app.kubernetes.io/version"] == chart(FINETUNE_CHART).metadata["appVersion"]
        assert labels["helm.sh/chart"] == "kubetune-finetune-" + chart(FINETUNE_CHART).metadata["version"]
        assert {"app.kubernetes.io/name", "app.kubernetes.io/managed-by"} <= set(labels)


def test_helm_test_waits_for_the_operator_to_find_this_finetune_valid():
    objs = objects(FINETUNE_CHART, {}, name="medical", namespace="ft")
    hooks = {o["kind"]: o for o in objs if o not in installed(objs)}
    assert set(hooks) == {"ServiceAccount", "Role", "RoleBinding", "Pod"}
    assert {o["metadata"]["annotations"]["helm.sh/hook"] for o in hooks.values()} == {"test"}
    pod = hooks["Pod"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:4] == ["wait", "finetune/medical", "--namespace=ft", "--for=condition=Valid"]
    assert container["image"] == "registry.k8s.io/kubectl:v1.33.0"
    assert pod["serviceAccountName"] == hooks["ServiceAccount"]["metadata"]["name"]
    (rule,) = hooks["Role"]["rules"]
    assert (rule["apiGroups"], rule["resources"]) == (["kubetune.io"], ["finetunes"])
    assert set(rule["verbs"]) <= {"get", "list", "watch"}  # reads, never writes
    binding = hooks["RoleBinding"]
    assert binding["roleRef"]["name"] == hooks["Role"]["metadata"]["name"]
    assert binding["subjects"][0]["name"] == hooks["ServiceAccount"]["metadata"]["name"]


def test_without_a_cluster_the_chart_renders_without_the_crd():
    # helm template / helm-python-sdk's render: lookup answers nothing and Capabilities has only the built-in
    # APIs, so the chart cannot tell a missing CRD from no cluster, and renders
    assert finetune({})["kind"] == "FineTune"


def test_installing_against_a_cluster_without_the_crd_names_the_operator_chart(kube):  # noqa: F811
    import kmock

    # Helm's own client against the emulated API server. kmock's lists have no `kind`, which Helm's lookup needs
    # (a real API server says SecretList): the release namespace's Secrets are answered as a cluster would.
    secrets = kmock.resource("v1", "secrets")
    kube.emulator["get", secrets, kmock.name(None)] << {"apiVersion": "v1", "kind": "SecretList", "items": []}
    helm = helm_python.Config(kubeconfig_path=str(kube.kubeconfig), namespace="fine-tuning")
    with pytest.raises(helm_python.HelmReleaseError) as refused:
        helm.install(chart(FINETUNE_CHART), "medical", {})
    assert str(refused.value).endswith(
        "this cluster has no FineTune CRD (finetunes.kubetune.io): install kubetune's operator chart first: "
        "helm install kubetune-operator charts/kubetune-operator -n kubetune-system --create-namespace"
    )
    # with the CRD served, the chart renders: Helm goes on to build the objects (and stops where kmock serves no
    # OpenAPI document, which is past the chart)
    kube.emulator.resources["kubetune.io/v1alpha1/finetunes"] = kmock.ResourceInfo(kind="FineTune", namespaced=True)
    helm = helm_python.Config(kubeconfig_path=str(kube.kubeconfig), namespace="fine-tuning")  # fresh discovery
    with pytest.raises(helm_python.HelmReleaseError, match="unable to build kubernetes objects from release manifest"):
        helm.install(chart(FINETUNE_CHART), "medical", {})


def test_the_readme_says_what_becomes_of_every_key_of_the_layout():
    from kubetune.recipe.helm_values import ALIASES, CHART_KEYS

    readme = (FINETUNE_CHART / "README.md").read_text().split("## Bring your values")[1]
    rows = set(re.findall(r"^\| `([^`]+)` \|", readme, re.M))
    assert {e["from"] for e in ALIASES} | set(CHART_KEYS) == rows


def test_the_seeds_prompts_are_kubetunes_alpaca_preamble():
    # why promptWithInput / promptWithoutInput map to data.template alpaca: the same sentences, with and without input
    from kubetune.data.templates import ALPACA
    from kubetune.recipe.helm_values import ALPACA_WITH_INPUT, ALPACA_WITHOUT_INPUT

    preamble = ALPACA.split("\n\n")[0]
    assert preamble.format(ctx=", paired with an input that provides further context") == ALPACA_WITH_INPUT
    assert preamble.format(ctx="") == ALPACA_WITHOUT_INPUT
    train = seed_values()["distributed"]["train"]
    assert (train["promptWithInput"], train["promptWithoutInput"]) == (ALPACA_WITH_INPUT, ALPACA_WITHOUT_INPUT)
