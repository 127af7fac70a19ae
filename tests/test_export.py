"""Export: the merged model generates the same text as base + adapter."""

import pytest
import torch

from kubetune.export import export_run, load_trained
from kubetune.training.run import train_from_recipe

from .conftest import SHARED_DATA, run_cli


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
    adapted, tokenizer = load_trained(run, dtype=torch.float32)
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
    first = run_cli(args, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "perplexity" in first.stdout and "after:" in first.stdout
    again = run_cli(args, timeout=600)  # the same command on a finished run resumes at the end: no new steps
    assert again.returncode == 0 and "resumed from" in again.stderr
    exp = run_cli(["export", str(run), "--merged", "-o", str(tmp_path / "merged")], timeout=600)
    assert exp.returncode == 0, exp.stderr[-2000:]
    gen = run_cli(
        ["generate", str(tmp_path / "merged"), "--prompt", "What does insulin do?", "--max-new-tokens", "12"],
        timeout=600,
    )
    assert gen.returncode == 0 and len(gen.stdout.strip()) > 0, gen.stderr[-2000:]
    gen_run = run_cli(
        ["generate", str(run), "--prompt", "What does insulin do?", "--max-new-tokens", "12"], timeout=600
    )
    assert gen_run.returncode == 0 and gen_run.stdout.strip() == gen.stdout.strip()
