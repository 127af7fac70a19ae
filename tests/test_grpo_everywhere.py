"""A GRPO run goes everywhere an SFT run goes: the shipped GRPO recipe renders as a cluster job on
every profile and validates, `k8s submit` creates it, the operator accepts a FineTune with
objective grpo, and a tiny GRPO run exports an ordinary PEFT adapter and is served."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import yaml

from kubetune.operator.crd import API_VERSION, KIND, check_finetune
from kubetune.recipe import load_recipe
from tests.k8s.conftest import TOKEN
from tests.k8s.conftest import cli as cli  # fixtures shared with tests/k8s and tests/operator
from tests.k8s.conftest import kube as kube
from tests.kit.kube import pod_recipe
from tests.operator.conftest import cluster as cluster
from tests.operator.conftest import operator as operator
from tests.operator.conftest import wait_for

RECIPE = "smollm2-135m-grpo-cpu"


def test_the_shipped_grpo_recipe_is_lora_grpo_on_a_builtin_task_with_held_out_prompts():
    r = load_recipe(RECIPE).recipe
    assert (r.finetune.method, r.finetune.objective) == ("lora", "grpo")
    assert r.data.train.startswith("builtin:") and r.data.eval is not None
    assert "accuracy" in [f if isinstance(f, str) else f.name for f in r.finetune.rl.reward_funcs]
    opening = load_recipe(RECIPE).source.read_text().splitlines()[:6]
    assert any(f"kubetune train {RECIPE}" in line for line in opening)  # the file opens with its command


@pytest.mark.parametrize("profile", ["cpu", "gaudi", "nvidia"])
def test_the_grpo_recipe_renders_as_a_valid_cluster_job_on_every_profile(cli, profile):
    result = cli("k8s", "render", RECIPE, "--profile", profile, "--check")
    assert result.code == 0, result.err
    assert "all valid" in result.err
    objects = [d for d in yaml.safe_load_all(result.out) if d]
    assert {"PyTorchJob", "ConfigMap"} <= {o["kind"] for o in objects}
    rendered = pod_recipe(objects)
    assert rendered["finetune"]["objective"] == "grpo"
    assert rendered["finetune"]["rl"] == load_recipe(RECIPE).recipe.finetune.rl.model_dump(mode="json")


def test_submit_creates_the_grpo_job_against_an_api_server(cli, kube, tmp_path):
    token = tmp_path / "hf-token"
    token.write_text(TOKEN + "\n")
    result = cli("k8s", "submit", RECIPE, "--hf-token-file", str(token))
    assert result.code == 0, result.err
    assert f"created PyTorchJob kubetune/{RECIPE}" in result.out
    config_maps = list(kube.objects("v1/configmaps").values())
    assert pod_recipe(config_maps)["finetune"]["objective"] == "grpo"


def _grpo_finetune_spec() -> dict:
    return {
        "recipe": {
            "finetune": {"objective": "grpo", "rl": {"num_generations": 4, "reward_funcs": ["accuracy"]}},
            "train": {"max_steps": 20, "micro_batch_size": 4},
        },
        "profile": "cpu",
    }


def test_a_grpo_finetune_validates_against_the_crd():
    spec = _grpo_finetune_spec()
    assert check_finetune({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "ft"}, "spec": spec}) == []
    spec["recipe"] = load_recipe(RECIPE).recipe.model_dump(mode="json")  # every key of the shipped recipe, declared
    assert check_finetune({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "ft"}, "spec": spec}) == []
    spec["recipe"] = {"finetune": {"objective": "grpo", "rl": {"num_generation": 4}}}
    assert check_finetune({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "ft"}, "spec": spec})


def test_the_operator_creates_the_job_of_a_grpo_finetune(operator):
    operator.apply_finetune("rl", _grpo_finetune_spec())
    wait_for(lambda: operator.get("kubeflow.org/v1", "PyTorchJob", "rl"), message="the PyTorchJob")
    config_map = wait_for(lambda: operator.get("v1", "ConfigMap", "rl-recipe"), message="the recipe ConfigMap")
    rendered = pod_recipe([config_map])
    assert rendered["finetune"]["objective"] == "grpo" and rendered["finetune"]["rl"]["num_generations"] == 4
    valid = wait_for(lambda: operator.condition("rl", "Valid"), message="the Valid condition")
    assert valid["status"] == "True", valid


# ------------------------------------------------------------------ a tiny GRPO run: export and serve


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, tiny_model_dir):
    from tests.serve.conftest import train_tiny_run

    root = tmp_path_factory.mktemp("grpo")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i)}) + "\n" for i in range(24)))
    return train_tiny_run(
        root / "run",
        tiny_model_dir,
        prompts,
        "finetune.objective=grpo",
        "finetune.rl.num_generations=4",
        "finetune.rl.max_completion_length=6",
        "finetune.rl.reward_funcs=[tests.training.rl_rewards:even_tokens]",
        "train.micro_batch_size=4",
        "train.grad_accum=1",
        "train.max_steps=3",
    )


@pytest.mark.process  # trains (torch's DCP checkpoints) and reloads
def test_a_grpo_run_exports_an_ordinary_peft_adapter(grpo_run, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kubetune.export.merged import export_run

    records = [json.loads(line) for line in (grpo_run / "metrics.jsonl").read_text().splitlines()]
    assert all("rewards/even_tokens/mean" in r for r in records)  # it trained with GRPO
    adapter = export_run(grpo_run, merged=False, output=tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    x = torch.tensor([[11, 12, 13, 14]])
    with torch.no_grad():
        before = base(x).logits
        after = PeftModel.from_pretrained(base, str(adapter)).eval()(x).logits
    assert not torch.allclose(before, after, atol=1e-6)  # the adapter holds what GRPO learned


@pytest.mark.process
def test_a_grpo_run_is_served_and_answers_a_completion(grpo_run):
    from tests.serve.conftest import ServerProcess

    server = ServerProcess([str(grpo_run), "--dtype", "fp32"])
    try:
        reply = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": grpo_run.name, "prompt": "Say 3.", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
    finally:
        server.stop()
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1


def test_the_page_documents_every_rl_key():
    from pathlib import Path

    from kubetune.recipe.rl import RLSection

    page = (Path(__file__).resolve().parents[1] / "docs" / "rl.md").read_text()
    keys = [f"finetune.rl.{k}" for k in RLSection.model_fields]
    assert [k for k in keys if f"`{k}`" not in page] == []
    assert f"kubetune train {RECIPE}" in page
