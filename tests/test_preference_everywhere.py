"""A DPO run goes everywhere an SFT run goes: the shipped DPO recipe renders as a cluster job on
every profile and validates, `k8s submit` creates it, the operator accepts a FineTune with
objective dpo, and a tiny DPO run exports an ordinary PEFT adapter and is served."""

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

RECIPE = "smollm2-135m-dpo-cpu"


def test_the_shipped_dpo_recipe_is_lora_dpo_on_pairs_with_held_out_pairs():
    r = load_recipe(RECIPE).recipe
    assert (r.finetune.method, r.finetune.objective, r.finetune.beta) == ("lora", "dpo", 0.1)
    assert r.data.train.endswith(".jsonl") and r.data.eval == 0.1
    lora = load_recipe("smollm2-135m-lora-cpu").recipe.lora
    assert r.lora == lora  # the SFT recipe's adapter


@pytest.mark.parametrize("profile", ["cpu", "gaudi", "nvidia"])
def test_the_dpo_recipe_renders_as_a_valid_cluster_job_on_every_profile(cli, profile):
    result = cli("k8s", "render", RECIPE, "--profile", profile, "--check", "data.train=/data/pairs.jsonl")
    assert result.code == 0, result.err
    assert "all valid" in result.err
    objects = [d for d in yaml.safe_load_all(result.out) if d]
    assert {"PyTorchJob", "ConfigMap", "PersistentVolumeClaim"} <= {o["kind"] for o in objects}
    rendered = pod_recipe(objects)
    assert rendered["finetune"]["objective"] == "dpo" and rendered["finetune"]["preference"]["beta"] == 0.1
    assert rendered["data"]["train"] == "/data/pairs.jsonl"


def test_submit_creates_the_dpo_job_against_an_api_server(cli, kube, tmp_path):
    token = tmp_path / "hf-token"
    token.write_text(TOKEN + "\n")
    result = cli("k8s", "submit", RECIPE, "--hf-token-file", str(token), "data.train=/data/pairs.jsonl")
    assert result.code == 0, result.err
    assert f"created PyTorchJob kubetune/{RECIPE}" in result.out
    config_maps = list(kube.objects("v1/configmaps").values())
    assert pod_recipe(config_maps)["finetune"]["objective"] == "dpo"


def _dpo_finetune_spec() -> dict:
    return {
        "recipe": {
            "finetune": {"objective": "dpo", "preference": {"beta": 0.2, "reference": "adapter_off"}},
            "data": {"train": "/data/pairs.jsonl", "eval": 0.1},
            "train": {"max_steps": 20},
        },
        "profile": "cpu",
    }


def test_a_dpo_finetune_validates_against_the_crd():
    spec = _dpo_finetune_spec()
    assert check_finetune({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "ft"}, "spec": spec}) == []
    shipped = load_recipe(RECIPE).recipe.model_dump(mode="json")  # every key of the shipped recipe, declared
    spec["recipe"] = shipped
    assert check_finetune({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "ft"}, "spec": spec}) == []
    spec["recipe"] = {"finetune": {"objective": "kto"}}
    assert check_finetune({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "ft"}, "spec": spec})


def test_the_operator_creates_the_job_of_a_dpo_finetune(operator):
    operator.apply_finetune("prefs", _dpo_finetune_spec())
    wait_for(lambda: operator.get("kubeflow.org/v1", "PyTorchJob", "prefs"), message="the PyTorchJob")
    config_map = wait_for(lambda: operator.get("v1", "ConfigMap", "prefs-recipe"), message="the recipe ConfigMap")
    rendered = pod_recipe([config_map])
    assert rendered["finetune"]["objective"] == "dpo" and rendered["finetune"]["preference"]["beta"] == 0.2
    valid = wait_for(lambda: operator.condition("prefs", "Valid"), message="the Valid condition")
    assert valid["status"] == "True", valid


# ------------------------------------------------------------------ a tiny DPO run: export and serve


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, tiny_model_dir):
    from tests.serve.conftest import train_tiny_run

    root = tmp_path_factory.mktemp("dpo")
    pairs = root / "pairs.jsonl"
    rows = [
        {
            "instruction": "Answer truthfully",
            "input": f"What is {i} plus {i}?",
            "chosen": f"{2 * i}.",
            "rejected": f"{2 * i + 1}.",
        }
        for i in range(24)
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train_tiny_run(root / "run", tiny_model_dir, pairs, "finetune.objective=dpo", "train.max_steps=3")


@pytest.mark.process  # trains (torch's DCP checkpoints) and reloads
def test_a_dpo_run_exports_an_ordinary_peft_adapter(dpo_run, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kubetune.export.merged import export_run

    records = [json.loads(line) for line in (dpo_run / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/accuracies" in r for r in records)  # it trained with the DPO objective
    adapter = export_run(dpo_run, merged=False, output=tmp_path / "adapter")
    assert (adapter / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    x = torch.tensor([[11, 12, 13, 14]])
    with torch.no_grad():
        before = base(x).logits
        tuned = PeftModel.from_pretrained(base, str(adapter)).eval()
        after = tuned(x).logits
    assert not torch.allclose(before, after, atol=1e-5)  # the adapter holds what DPO learned


@pytest.mark.process
def test_a_dpo_run_is_served_and_answers_a_completion(dpo_run):
    from tests.serve.conftest import ServerProcess

    server = ServerProcess([str(dpo_run), "--dtype", "fp32"])
    try:
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
        name = next(m["id"] for m in models["data"] if m["id"] == dpo_run.name)
        reply = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": name, "prompt": "What is 3 plus 3?", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
    finally:
        server.stop()
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] in ("length", "stop") and reply.json()["usage"]["completion_tokens"] >= 1


# ------------------------------------------------------------------ the recipe's commands and the page


def _opening_commands() -> list[list[str]]:
    path = load_recipe(RECIPE).source
    return [ln.lstrip("# ").split("#")[0].split() for ln in path.read_text().splitlines()[:8] if "kubetune " in ln]


def test_the_recipes_opening_commands_make_the_file_it_trains_on():
    import typer.main

    from kubetune import cli as kubetune_cli

    make = next(c for c in _opening_commands() if c[1:3] == ["data", "make-preferences"])
    assert "make-preferences" in typer.main.get_command(kubetune_cli.app).commands["data"].commands
    args = make[3:]
    out = args[args.index("--out") + 1]
    source = load_recipe(args[0], [a for a in args[1:] if "=" in a]).recipe  # the recipe the pairs come from
    assert source.data.train == "builtin:medical_flashcards_sample"
    assert out == load_recipe(RECIPE).recipe.data.train  # what make-preferences writes, training reads
    assert ["kubetune", "train", RECIPE] in _opening_commands()


def test_the_page_documents_every_preference_key():
    from pathlib import Path

    from kubetune.recipe.schema import PreferenceSection

    page = (Path(__file__).resolve().parents[1] / "docs" / "preference.md").read_text()
    keys = [f"finetune.preference.{k}" for k in PreferenceSection.model_fields]
    keys += ["finetune.objective", "data.columns.chosen", "data.columns.rejected"]
    assert [k for k in keys if f"`{k}`" not in page] == []
    assert "kubetune data make-preferences smollm2-135m-dpo-cpu data.train=builtin:medical_flashcards_sample" in page
