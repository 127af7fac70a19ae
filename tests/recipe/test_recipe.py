import pytest
import yaml

from kubetune.errors import RecipeError
from kubetune.recipe import builtin_recipes, load_recipe
from kubetune.recipe.loader import all_keys, reference_markdown
from tests.kit.paths import REPO


@pytest.mark.parametrize("name", sorted(builtin_recipes()))
def test_every_shipped_recipe_loads_and_opens_with_its_command(name):
    path = builtin_recipes()[name]
    loaded = load_recipe(name)
    assert loaded.source == path
    commands = [ln for ln in path.read_text().splitlines()[:8] if ln.lstrip("# ").startswith("kubetune ")]
    assert commands, f"{path.name} must open with the command that runs it"
    assert any(c.lstrip("# ").startswith("kubetune train") for c in commands)


def test_default_recipe_is_the_embedded_model_on_builtin_data():
    r = load_recipe(None).recipe
    assert r.model.name_or_path == "smollm2-135m-instruct"
    assert r.data.train.startswith("builtin:")


def test_overrides_are_typed_and_recorded():
    loaded = load_recipe(None, ["train.lr=1e-3", "lora.target_modules=[q_proj,v_proj]", "train.compile=true"])
    assert loaded.recipe.train.lr == pytest.approx(1e-3)
    assert loaded.recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert loaded.recipe.train.compile is True
    assert loaded.provenance["train.lr"] == "command line"
    assert loaded.provenance["model.dtype"] == "default"
    assert loaded.provenance["lora.r"].endswith(".yaml")


def test_unknown_keys_get_the_nearest_valid_key_and_all_problems_come_at_once():
    with pytest.raises(RecipeError) as exc:
        load_recipe(None, ["train.learning_rate=1", "lora.rr=2", "train.precision=bf8", "train.micro_batch_size=x"])
    problems = exc.value.problems
    assert len(problems) == 4
    text = "\n".join(problems)
    assert "`lora.rr`" in text and "`lora.r`" in text
    assert "`train.learning_rate`" in text
    assert "`train.precision`" in text and "bf16" in text
    assert "`train.micro_batch_size`" in text


def test_yaml_off_on_mean_what_users_meant(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  gradient_checkpointing: off\n")
    assert load_recipe(p).recipe.train.gradient_checkpointing == "off"
    assert load_recipe(p, ["train.gradient_checkpointing=on"]).recipe.train.gradient_checkpointing == "on"


def test_bad_yaml_and_missing_file_are_one_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train: [unclosed\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe(p)
    assert "not valid YAML" in str(exc.value)
    with pytest.raises(RecipeError) as exc:
        load_recipe(tmp_path / "nope.yaml")
    assert "not found" in str(exc.value)


def test_eval_fraction_and_template_are_validated():
    with pytest.raises(RecipeError, match="between 0 and 1"):
        load_recipe(None, ["data.eval=1.5"])
    with pytest.raises(RecipeError, match="instruction"):
        load_recipe(None, ["data.template=Question: {question}"])
    assert load_recipe(None, ["data.template=Q: {instruction} {input}\nA: "]).recipe.data.template.startswith("Q:")


def test_reference_lists_every_leaf_key():
    ref = reference_markdown()
    for key in (
        "model.name_or_path",
        "train.gradient_checkpointing",
        "data.packing",
        "lora.target_modules",
        "output_dir",
        "train.resume",
    ):
        assert f"`{key}`" in ref
    assert len(all_keys()) > 40
    assert yaml.safe_load(yaml.safe_dump({"a": 1}))  # PyYAML present for users' recipes


def test_readme_recipe_reference_is_the_generated_table():
    page = (REPO / "docs" / "recipe.md").read_text()
    assert reference_markdown().strip() in page, "regenerate docs/recipe.md's table with `kubetune recipe reference`"


def test_runs_recorded_before_global_batch_size_and_template_auto_stay_resumable():
    """run.json's fingerprint, as kubetune wrote it before train.global_batch_size existed and while
    data.template defaulted to chat: the same recipe file, read now (global_batch_size null, template
    auto), still has that fingerprint, so rerunning it resumes instead of stopping at "a different recipe"."""
    import hashlib
    import json

    from kubetune.rundir import NEUTRAL, fingerprint

    def recorded_before(recipe) -> str:
        d = recipe.model_dump(mode="json")
        del d["train"]["global_batch_size"]  # the key did not exist
        del d["finetune"]["rl"]  # nor GRPO's section
        del d["data"]["columns"]["prompt"]  # nor its prompt column
        d["data"]["template"] = "chat"  # the default was chat
        for section, keys in NEUTRAL.items():  # as fingerprint() leaves out what does not change the math
            if keys is None:
                d.pop(section, None)
            for key in keys or ():
                d.get(section, {}).pop(key, None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    recipe = load_recipe(None, ["data.template=auto"]).recipe
    assert fingerprint(recipe) == recorded_before(recipe)
    # a global batch, or another template, is another recipe
    assert fingerprint(load_recipe(None, ["data.template=alpaca"]).recipe) != fingerprint(recipe)
    assert fingerprint(load_recipe(None, ["finetune.rl.beta=0.1"]).recipe) != fingerprint(recipe)
    assert fingerprint(load_recipe(None, ["train.global_batch_size=8", "train.grad_accum=1"]).recipe) != fingerprint(
        recipe
    )


@pytest.mark.parametrize(
    "given,expected",
    [("mlflow", ["mlflow"]), ("none", []), ("[tensorboard,wandb]", ["tensorboard", "wandb"]), ("[]", [])],
)
def test_report_to_takes_hf_trainers_spellings(given, expected):
    assert load_recipe(None, [f"monitor.report_to={given}"]).recipe.monitor.report_to == expected


@pytest.mark.parametrize(
    "given,message",
    [
        ("[mlflow,comet]", "`monitor.report_to.1`: got 'comet', expected 'tensorboard', 'mlflow', 'wandb'"),
        ("[mlflow,mlflow]", "`monitor.report_to`: names a tracker twice"),
    ],
)
def test_report_to_refuses_unknown_and_repeated_trackers_in_one_line(given, message):
    with pytest.raises(RecipeError) as e:
        load_recipe(None, [f"monitor.report_to={given}"])
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(message), e.value.problems
