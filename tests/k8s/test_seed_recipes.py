"""The shipped recipes are the seeds' jobs, and render checks a layout as training does.

Seed 002: 4 Xeon workers of 200 CPUs / 226Gi, 3 epochs, lr 2e-5, LoRA r 8 / alpha 16, bf16.
Seed 000: a Llama-2-13B-class model on 8 nodes x 4 Gaudi2, tp 4 in a node, pp across nodes,
a global batch of 2048 rows. Render must refuse what the pods would refuse (tp against the
model's heads, KV heads and MLP width, and against the processes of a pod; 1f1b against the
micro-batches of a step; a global batch that does not split), without torch or the network.
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


def test_seed_002_renders_four_workers_of_200_cpus_and_its_hyperparameters(cli, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_a_made_up_token_for_the_check")  # Llama 2 is gated: --check wants a token
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


def test_seed_000_renders_eight_pods_of_four_gaudi_cards_with_tp_4(cli, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_a_made_up_token_for_the_check")  # Llama 2 is gated: --check wants a token
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
    assert pod_recipe(docs)["train"]["global_batch_size"] == 2048  # the seed's global batch
    # render says what a step is: 2048 rows = 4 per micro-batch x 512 micro-batches x 1 replica, ~1M tokens
    assert "global batch: 2,048 rows per optimizer step" in result.err
    assert "4 x 512 micro-batches x 1 data-parallel replica(s)" in result.err
    assert "up to 1,048,576 tokens per step" in result.err


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
    line = render_error(SEED_000, "train.global_batch_size=null", "train.grad_accum=4")
    assert "set train.grad_accum>=8 (it is 4)" in line
    r.render(load_recipe(SEED_000, ["train.global_batch_size=null", "train.grad_accum=8"]).recipe)
    # the seed's accumulation of 4 from its global batch: 512-row micro-batches, refused with the fix
    line = render_error(SEED_000, "train.micro_batch_size=512")
    assert "train.global_batch_size=2048 gives 4: lower train.micro_batch_size to at most 256 or use gpipe" in line
    r.render(load_recipe(SEED_000, ["train.micro_batch_size=512", "parallel.pp_schedule=gpipe"]).recipe)


def test_a_tensor_parallel_group_across_pods_fails_at_render():
    # the README: a tensor-parallel group stays inside a node; tp 8 on pods of 4 cards would not
    line = render_error(SEED_000, "parallel.tp=8", "parallel.pp=4")
    assert line.startswith("parallel.tp=8 splits tensor-parallel groups across pods (hosts) of 4 process(es)")
    assert "set parallel.tp to a divisor of 4 (1, 2, 4)" in line and "k8s.nproc_per_node" in line
    # 8 cards a pod: the group fits again
    gaudi8 = ["parallel.tp=8", "parallel.pp=4", "k8s.replicas=4", "k8s.nproc_per_node=8"]
    r.render(load_recipe(SEED_000, [*gaudi8, "k8s.profile_resources.gaudi.accelerators=8"]).recipe)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["train.micro_batch_size=3"],
            (
                "train.global_batch_size=2048 is not a whole number of passes of train.micro_batch_size=3 x 1 "
                "data-parallel replica(s) = 3 rows; set train.global_batch_size to a multiple of 3 (2046, 2049), or "
                "train.micro_batch_size to a divisor of 2048 (1, 2, 4, ..., 1024, 2048)"
            ),
        ),
        (
            ["train.micro_batch_size=4096"],
            (
                "train.global_batch_size=2048 is fewer rows than one pass of train.micro_batch_size=4096 x 1 "
                "data-parallel replica(s) = 4096 rows; set train.global_batch_size to a multiple of 4096 (4096), or "
                "train.micro_batch_size to a divisor of 2048 (1, 2, 4, ..., 1024, 2048)"
            ),
        ),
        (
            ["train.grad_accum=4"],
            (
                "train.grad_accum=4 disagrees with train.global_batch_size=2048, which gives 2048 / (4 x 1 replica(s)) "
                "= 512; remove train.grad_accum or set it to 1 (it is derived), or set train.global_batch_size=null"
            ),
        ),
        # pp 4 x dp 2 x tp 4 on the 32 processes: a pass is 8 rows x 2 replicas, and 1000 is not a multiple of 16
        (
            ["parallel.pp=4", "parallel.dp=2", "train.global_batch_size=1000", "train.micro_batch_size=8"],
            (
                "train.global_batch_size=1000 is not a whole number of passes of train.micro_batch_size=8 x 2 "
                "data-parallel replica(s) = 16 rows; set train.global_batch_size to a multiple of 16 (992, 1008), or "
                "train.micro_batch_size to a divisor of 500 (1, 2, 4, ..., 250, 500)"
            ),
        ),
    ],
)
def test_a_global_batch_that_does_not_split_fails_at_render_with_the_choices(overrides, message):
    assert render_error(SEED_000, *overrides) == message


def test_the_global_batch_sets_grad_accum_for_each_data_parallel_size():
    from kubetune.recipe.layout import grad_accum_for

    train = load_recipe(SEED_000).recipe.train
    assert [grad_accum_for(train, dp) for dp in (1, 2, 8)] == [512, 256, 64]
    unset = load_recipe(SEED_000, ["train.global_batch_size=null", "train.grad_accum=4"]).recipe.train
    assert [grad_accum_for(unset, dp) for dp in (1, 2)] == [4, 4]  # as before: rows per step grow with replicas


@pytest.mark.parametrize(
    "overrides,message",
    [
        # Llama-2-7b: 32 heads; tp 3 does not divide them
        (
            ["k8s.replicas=1", "k8s.nproc_per_node=3", "parallel.tp=3"],
            "parallel.tp=3 does not divide the model's 32 attention heads",
        ),
        # Llama-2-70b: 64 heads but 8 KV heads; tp 16 splits the heads, not the KV heads
        (
            [
                "model.name_or_path=meta-llama/Llama-2-70b-hf",
                "k8s.replicas=1",
                "k8s.nproc_per_node=16",
                "parallel.tp=16",
            ],
            "parallel.tp=16 does not divide the model's 8 key/value heads",
        ),
        # the embedded default: 9 heads
        (
            ["model.name_or_path=smollm2-135m-instruct", "k8s.replicas=1", "k8s.nproc_per_node=2", "parallel.tp=2"],
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


# ------------------------------------------------------------------ render checks the pods' memory


def test_a_pod_without_the_memory_of_its_model_fails_at_render(cli, monkeypatch):
    # seed 002's 7B job in bf16: 6.7B parameters x 2 bytes, 1.5 times over, plus 1.5Gi = ~20.3Gi a process
    monkeypatch.setenv("HF_TOKEN", "hf_a_made_up_token_for_the_check")
    result = cli("k8s", "render", SEED_002, "--check", "k8s.resources.memory=8Gi", "k8s.resources.shm_size=1Gi")
    assert result.code == 2, result.out
    (line,) = result.err.strip().splitlines()
    assert line == (
        "kubetune: error: k8s.resources.memory=8Gi is less than the ~20.3Gi one worker pod needs for "
        "meta-llama/Llama-2-7b-chat-hf: 1 training process(es), each 6.7B parameters in bf16 1.5 times over plus "
        "1.5Gi; set k8s.resources.memory to at least 21Gi"
    )
    r.render(load_recipe(SEED_002, ["k8s.resources.memory=21Gi", "k8s.resources.shm_size=1Gi"]).recipe)


def test_the_memory_check_counts_the_processes_and_stages_of_a_pod():
    # seed 000 on gaudi: the 13B weights pass through the host once, plus 1.5Gi for each of 4 processes
    line = render_error(SEED_000, "k8s.profile_resources.gaudi.memory=8Gi", "k8s.profile_resources.gaudi.shm_size=1Gi")
    assert line.startswith("k8s.profile_resources.gaudi.memory=8Gi is less than the ~30.2Gi one worker pod needs")
    assert "13.0B parameters in bf16 once (loaded through the host" in line and "each of 4 training process" in line
    assert line.endswith("or fewer processes per pod (k8s.nproc_per_node)")
    # on cpu, each of the 4 processes holds its stage: 1.6B of the 13B parameters, 1.5 times over
    line = render_error(SEED_000, "k8s.profile=cpu", "k8s.resources.memory=8Gi", "k8s.resources.shm_size=1Gi")
    assert "~24.2Gi" in line and "4 training process(es), each 1.6B parameters in bf16 1.5 times over" in line
    # a model whose size is unknown offline is not checked
    r.render(load_recipe(SEED_002, ["model.name_or_path=some-org/some-model", "k8s.resources.memory=8Gi"]).recipe)


def test_render_notes_say_what_the_recipe_left_implicit(cli, tmp_path):
    minimal = tmp_path / "minimal.yaml"
    minimal.write_text("model:\n  name_or_path: meta-llama/Llama-2-7b-hf\ndata:\n  train: medalpaca/flashcards\n")
    result = cli("k8s", "render", str(minimal))
    assert result.code == 0, result.err
    notes = [line.removeprefix("kubetune: ") for line in result.err.splitlines() if "warning" not in line]
    assert notes == [
        (
            "global batch: 8 rows per optimizer step (train.micro_batch_size=4 x 1 micro-batches x 2 data-parallel "
            "replica(s)), up to 4,096 tokens per step (rows of up to 512 tokens)"
        ),
        "data.template=auto: alpaca for meta-llama/Llama-2-7b-hf (its tokenizer has no chat template: a base model)",
        "k8s.replicas is not set: 2 worker pods (kubetune's default; Intel's huggingface-llm chart runs 4)",
    ]
    given = cli("k8s", "render", str(minimal), "k8s.replicas=4")
    assert "k8s.replicas is not set" not in given.err and "x 4 data-parallel replica(s)" in given.err
