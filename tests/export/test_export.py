"""Export: the merged model generates the same text as base + adapter."""

import pytest
import torch

from kubetune.export.merged import export_run
from kubetune.models.runs import load_run
from kubetune.training.run import train_from_recipe
from tests.kit.cli import run_cli_subprocess
from tests.kit.paths import SHARED_DATA

pytestmark = pytest.mark.process


def _greedy(model, tokenizer, prompt, n=12):
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out[0, enc["input_ids"].shape[1] :].tolist()


def test_merged_export_matches_base_plus_adapter(tmp_path, tiny_overrides):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    train_from_recipe(None, tiny_overrides + [f"output_dir={run}", "train.max_steps=4", "train.lr=5e-2"])
    merged_dir = export_run(run, merged=True)
    assert (merged_dir / "model.safetensors").is_file() and (merged_dir / "tokenizer.json").is_file()
    assert (merged_dir / "generation_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    adapted, tokenizer = load_run(run, dtype=torch.float32)
    adapted.eval()
    prompt = "Answer this question truthfully\n\nWhat is fact number 3?"
    assert _greedy(merged, tokenizer, prompt) == _greedy(adapted, tokenizer, prompt)
    with adapted.disable_adapter():  # the adapter really changed the model
        base_logits = adapted(**tokenizer(prompt, return_tensors="pt")).logits
    merged_logits = merged(**tokenizer(prompt, return_tensors="pt")).logits
    assert not torch.allclose(base_logits, merged_logits, atol=1e-4)


@pytest.mark.e2e
@pytest.mark.slow  # the default suite's real-model path is tests/serve/test_serve_e2e.py (train, serve, generate)
def test_real_model_train_resume_export_generate(tmp_path):
    """SmolLM2-135M end to end through the CLI: train, resume to more steps, export, generate."""
    data = SHARED_DATA / "train.jsonl" if (SHARED_DATA / "train.jsonl").is_file() else None
    run = tmp_path / "smol"
    args = [
        "train",
        "train.max_steps=2",
        "train.save_every=1",
        "train.micro_batch_size=2",
        "train.grad_accum=1",
        "eval.max_samples=8",
        "eval.generate=1",
        "eval.max_new_tokens=12",
        f"output_dir={run}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    if data:
        args += [f"data.train={data}", "data.max_train_samples=64"]
    first = run_cli_subprocess(args, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "perplexity" in first.stdout and "after:" in first.stdout
    again = run_cli_subprocess(args, timeout=600)  # the same command on a finished run resumes at the end: no new steps
    assert again.returncode == 0 and "resumed from" in again.stderr
    exp = run_cli_subprocess(["export", str(run), "--merged", "-o", str(tmp_path / "merged")], timeout=600)
    assert exp.returncode == 0, exp.stderr[-2000:]
    gen = run_cli_subprocess(
        ["generate", str(tmp_path / "merged"), "--prompt", "What does insulin do?", "--max-new-tokens", "12"],
        timeout=600,
    )
    assert gen.returncode == 0 and len(gen.stdout.strip()) > 0, gen.stderr[-2000:]
    gen_run = run_cli_subprocess(
        ["generate", str(run), "--prompt", "What does insulin do?", "--max-new-tokens", "12"], timeout=600
    )
    assert gen_run.returncode == 0 and gen_run.stdout.strip() == gen.stdout.strip()


def _snapshot(root, commit, layers, tokenizer, remote_code):
    """One commit of a hub repo in the cache layout huggingface_hub reads offline."""

    from tests.kit.models import give_own_code, save_tiny_model

    out = save_tiny_model(
        root / "snapshots" / commit,
        tokenizer,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    if remote_code:  # a model type transformers does not know: it loads only with trust_remote_code
        give_own_code(out, "tiny_remote")


@pytest.fixture
def pinned_remote_run(tmp_path, tokenizer, monkeypatch):
    """A LoRA run of hub model kubetune-test/tiny at revision v1 (two layers, its own modelling
    code), while its main branch is a plain one-layer Llama: dropping `revision` loads main."""
    import huggingface_hub.constants
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))  # read at each call
    repo = hub / "models--kubetune-test--tiny"
    _snapshot(repo, "a" * 40, 1, tokenizer, remote_code=False)
    _snapshot(repo, "b" * 40, 2, tokenizer, remote_code=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (repo / "refs" / "v1").write_text("b" * 40)
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(
        "model:\n  name_or_path: kubetune-test/tiny\n  revision: v1\n  trust_remote_code: true\n"
    )
    (run / "run.json").write_text("{}")
    base = AutoModelForCausalLM.from_pretrained("kubetune-test/tiny", revision="v1", trust_remote_code=True)
    adapted = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    adapted.save_pretrained(run / "adapter")
    tokenizer.save_pretrained(run / "adapter")
    return run


def test_every_reader_loads_a_run_at_its_revision_with_its_code(pinned_remote_run):
    from kubetune.rundir import RunDir
    from kubetune.serve.native.models import load_served

    def is_v1(lm):
        return type(lm).__name__ == "TinyRemoteForCausalLM" and lm.config.num_hidden_layers == 2

    adapted, _ = load_run(pinned_remote_run)  # eval, generate and export
    assert is_v1(adapted.get_base_model())
    base, _ = load_run(RunDir(pinned_remote_run).recipe())  # eval of the base model a recipe names
    assert is_v1(base)
    assert is_v1(load_served(str(pinned_remote_run), [], torch.float32, "sdpa").lm)
