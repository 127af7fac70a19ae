"""Seed 002's custom prompt template, end to end: recipe file -> tokenize -> train -> generate.

The template names only `{input}` and is Chinese; it must survive the recipe file, the run
directory's saved recipe, byte-level tokenization and `kubetune generate` unchanged.
"""

import json

import kubetune.serve.generate
from kubetune.data.templates import PromptRenderer
from kubetune.data.tokenize import tokenize_rows
from kubetune.models.decoding import generate_text
from kubetune.rundir import RunDir
from kubetune.serve.generate import generate_cli
from kubetune.training.run import train_from_recipe

SEED_002_TEMPLATE = "你是一个专业的医疗助手。请根据问题给出准确的回答。\n问题:{input}\n回答:"
QUESTION = "胰岛素的作用是什么?"


def _seed_rows() -> list[dict[str, str]]:
    """As in medical flashcards: instruction + input, and rows with only an input."""
    rows = [
        {
            "instruction": "Answer this question truthfully",
            "input": f"第{i}号药物的作用是什么?",
            "output": f"第{i}号药物降低血压。",
        }
        for i in range(12)
    ]
    return rows + [{"input": f"疾病{i}的症状是什么?", "output": f"疾病{i}会引起发热。"} for i in range(12)]


def test_seed_002_template_tokenizes_trains_and_generates(tmp_path, tiny_overrides, monkeypatch):
    data = tmp_path / "zh.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _seed_rows()), encoding="utf-8")
    recipe = tmp_path / "seed002.yaml"
    recipe.write_text(f"data:\n  template: {json.dumps(SEED_002_TEMPLATE, ensure_ascii=False)}\n", encoding="utf-8")
    out = tmp_path / "run"
    summary = train_from_recipe(
        str(recipe),
        tiny_overrides + [f"data.train={data}", "train.max_steps=2", "eval.generate=2", f"output_dir={out}"],
    )
    assert summary is not None and summary.samples
    for sample in summary.samples:  # the eval prompts are the seed's, with the row's question
        assert sample["prompt"].startswith(SEED_002_TEMPLATE.split("{input}")[0])
        assert sample["prompt"].endswith("?\n回答:") and "Answer this question" not in sample["prompt"]

    assert RunDir(out).recipe().data.template == SEED_002_TEMPLATE  # through the run's saved recipe
    # a tiny random model answers every prompt alike, so record the prompt generation really
    # runs on (the real generate_text, called through)
    seen: list[str] = []

    def recording(lm, tok, prompt, *args, **kwargs):
        seen.append(prompt)
        return generate_text(lm, tok, prompt, *args, **kwargs)

    monkeypatch.setattr(kubetune.serve.generate, "generate_text", recording)
    answer = generate_cli(str(out), QUESTION, max_new_tokens=6)
    assert seen == [SEED_002_TEMPLATE.format(input=QUESTION)] and isinstance(answer, str)


def test_seed_002_template_trains_only_on_the_answer(tokenizer):
    row = {"instruction": "", "input": QUESTION, "output": "降低血糖。"}
    data = tokenize_rows([row], PromptRenderer(SEED_002_TEMPLATE, tokenizer), tokenizer, 128, True)
    ids, trainable = data.sample(0)
    assert tokenizer.decode(ids[~trainable]) == SEED_002_TEMPLATE.format(input=QUESTION)
    assert tokenizer.decode(ids[trainable], skip_special_tokens=True) == "降低血糖。"
