"""The shipped recipes are the seeds' jobs, and render checks a layout as training does.

Seed 002: 4 Xeon workers of 200 CPUs / 226Gi, 3 epochs, lr 2e-5, LoRA r 8 / alpha 16, bf16.
Seed 000: a Llama-2-13B-class model on 8 nodes x 4 Gaudi2, tp 4 in a node, pp across nodes,
grad_accum 4. Render must refuse what the pods would refuse (tp against the model's heads,
KV heads and MLP width; 1f1b against grad_accum), without torch or the network.
"""

from __future__ import annotations

import json

import pytest
import yaml

from kubetune.errors import RecipeError
from kubetune.k8s import render as r
from kubetune.recipe.layout import KNOWN_SHAPES, model_shape
from kubetune.recipe.loader import load_recipe

SEED_002 = "llama2-7b-medical-flashcards"
SEED_000 = "llama2-13b-gaudi-tp4-pp8"


def docs_of(out: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(out) if d]


def replica_pods(job: dict) -> list[tuple[int, dict]]:
    """(replicas, container) per replica type of a PyTorchJob."""
    specs = job["spec"]["pytorchReplicaSpecs"].values()
    return [(rs["replicas"], rs["template"]["spec"]["containers"][0]) for rs in specs]


def pod_recipe(docs: list[dict]) -> dict:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    return yaml.safe_load(cm["data"]["recipe.yaml"])


def test_seed_002_renders_four_workers_of_200_cpus_and_its_hyperparameters(cli):
    result = cli("k8s", "render", SEED_002, "--profile", "cpu", "--check")
    assert result.code == 0, result.err
    docs = docs_of(result.out)
    job = docs[-1]
    # the seed's layout: 4 Workers, no Master, a c10d rendezvous (at <job>-worker-0) for exactly 4
    assert {kind: rs["replicas"] for kind, rs in job["spec"]["pytorchReplicaSpecs"].items()} == {"Worker": 4}
    policy = job["spec"]["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"], policy["rdzvBackend"]) == (4, 4, "c10d")
    pods = replica_pods(job)
    for _, container in pods:
        res = container["resources"]
        assert res["limits"] == res["requests"] == {"cpu": "200", "memory": "226Gi"}  # Guaranteed QoS
        assert {e["name"]: e.get("value") for e in container["env"]}["OMP_NUM_THREADS"] == "200"
    recipe = pod_recipe(docs)
    assert recipe["train"]["epochs"] == 3 and recipe["train"]["lr"] == pytest.approx(2e-5)
    assert recipe["train"]["precision"] == "bf16"  # said, not left to the start-up probe
    assert (recipe["lora"]["r"], recipe["lora"]["alpha"]) == (8, 16)
    assert recipe["data"]["train"] == "medalpaca/medical_meadow_medical_flashcards"
    assert recipe["model"]["name_or_path"] == "meta-llama/Llama-2-7b-chat-hf"


def test_seed_002_cpu_sizes_stay_on_the_cpu_profile():
    # 200 CPUs would not fit a Gaudi or GPU node: other profiles keep their own defaults.
    gaudi = load_recipe(SEED_002, ["k8s.profile=gaudi"]).recipe.k8s.worker_resources()
    assert (gaudi["cpu"], gaudi["memory"], gaudi["accelerators"]) == ("64", "400Gi", 8)
    # and a command-line k8s.resources value always takes effect
    cpu = load_recipe(SEED_002, ["k8s.resources.cpu=100"]).recipe.k8s.worker_resources()
    assert (cpu["cpu"], cpu["memory"]) == (100, "226Gi")


def test_seed_000_renders_eight_pods_of_four_gaudi_cards_with_tp_4(cli):
    result = cli("k8s", "render", SEED_000, "--check")
    assert result.code == 0, result.err
    docs = docs_of(result.out)
    job = docs[-1]
    assert job["spec"]["nprocPerNode"] == "4"
    pods = replica_pods(job)
    assert sum(n for n, _ in pods) == 8
    for _, container in pods:
        limits = container["resources"]["limits"]
        assert limits["habana.ai/gaudi"] == "4" and limits == container["resources"]["requests"]
    parallel = pod_recipe(docs)["parallel"]
    assert (parallel["tp"], parallel["pp"], parallel["dp"]) == (4, 8, 1)
    assert pod_recipe(docs)["train"]["grad_accum"] == 4


@pytest.mark.parametrize("profile", ["cpu", "nvidia"])
def test_seed_000_keeps_its_layout_on_other_profiles(profile):
    recipe = load_recipe(SEED_000, [f"k8s.profile={profile}"]).recipe
    assert recipe.k8s.processes_per_pod() * recipe.k8s.replicas == 32
    r.render(recipe)  # the same 32-process layout renders


# ------------------------------------------------------------------ render checks the layout


def render_error(recipe: str, *overrides: str) -> str:
    with pytest.raises(RecipeError) as err:
        r.render(load_recipe(recipe, list(overrides)).recipe)
    (line,) = err.value.problems
    return line


def test_1f1b_with_fewer_micro_batches_than_stages_fails_at_render():
    line = render_error(SEED_000, "parallel.pp_schedule=1f1b")
    assert "set train.grad_accum>=8 (it is 4)" in line
    r.render(load_recipe(SEED_000, ["parallel.pp_schedule=1f1b", "train.grad_accum=8"]).recipe)


@pytest.mark.parametrize(
    "overrides,message",
    [
        # Llama-2-7b: 32 heads; tp 3 does not divide them
        (["k8s.replicas=3", "parallel.tp=3"], "parallel.tp=3 does not divide the model's 32 attention heads"),
        # Llama-2-70b: 64 heads but 8 KV heads; tp 16 splits the heads, not the KV heads
        (
            [
                "model.name_or_path=meta-llama/Llama-2-70b-hf",
                "k8s.replicas=2",
                "k8s.nproc_per_node=8",
                "parallel.tp=16",
            ],
            "parallel.tp=16 does not divide the model's 8 key/value heads",
        ),
        # the embedded default: 9 heads
        (
            ["model.name_or_path=smollm2-135m-instruct", "k8s.replicas=2", "parallel.tp=2"],
            "parallel.tp=2 does not divide the model's 9 attention heads",
        ),
    ],
)
def test_tensor_parallel_degrees_the_model_cannot_split_fail_at_render(overrides, message):
    assert message in render_error(SEED_002, *overrides)


def test_more_pipeline_stages_than_layers_fail_at_render():
    line = render_error(SEED_002, "k8s.replicas=40", "parallel.pp=40")
    assert "parallel.pp=40 is more stages than the model's 32 decoder layers" in line


def test_a_local_model_directory_is_read_from_its_config_json(tmp_path):
    config = {"num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 102, "num_hidden_layers": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    base = [f"model.name_or_path={tmp_path}", "k8s.replicas=1", "k8s.nproc_per_node=4", "parallel.tp=4"]
    assert "does not divide the model's 102 MLP width (intermediate_size)" in render_error(SEED_002, *base)
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    r.render(load_recipe(SEED_002, base).recipe)  # now it divides


def test_an_unknown_model_warns_and_renders():
    recipe = load_recipe(SEED_000, ["model.name_or_path=some-org/some-model"]).recipe
    warnings = r.render(recipe).warnings
    assert any("model.name_or_path=some-org/some-model: its shape" in w and "parallel.tp=4" in w for w in warnings)
    assert not any("its shape" in w for w in r.render(load_recipe(SEED_000).recipe).warnings)


@pytest.mark.parametrize(
    "name,heads,kv,width,layers",
    [
        # the numbers in each repository's config.json on huggingface.co
        ("meta-llama/Llama-2-7b-hf", 32, 32, 11008, 32),
        ("meta-llama/Llama-2-13b-chat-hf", 40, 40, 13824, 40),
        ("meta-llama/Llama-2-70b-hf", 64, 8, 28672, 80),
        ("meta-llama/Meta-Llama-3-8B", 32, 8, 14336, 32),
        ("meta-llama/Meta-Llama-3-70B-Instruct", 64, 8, 28672, 80),
        ("mistralai/Mistral-7B-v0.1", 32, 8, 14336, 32),
        ("smollm2-135m-instruct", 9, 3, 1536, 30),
    ],
)
def test_known_shapes(name, heads, kv, width, layers):
    shape = model_shape(name)
    assert shape is not None
    assert (shape.num_attention_heads, shape.num_key_value_heads) == (heads, kv)
    assert (shape.intermediate_size, shape.num_hidden_layers) == (width, layers)
    assert all(k == k.lower() for k in KNOWN_SHAPES)  # looked up lower-case
