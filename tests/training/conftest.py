"""Fixtures of the GRPO tests (test_grpo.py, test_grpo_server.py): a prompt file and a tiny GRPO recipe."""

import json

import pytest

EVEN = "tests.training.rl_rewards:even_tokens"


@pytest.fixture
def prompts_file(tmp_path):
    rows = [{"prompt": f"Count to {i}.", "answer": " ".join(str(k) for k in range(1, i + 1))} for i in range(1, 41)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def grpo_overrides(tiny_overrides, prompts_file):
    keep = ("data.train=", "eval.generate", "train.max_steps", "train.micro_batch_size", "train.grad_accum")
    return [o for o in tiny_overrides if not o.startswith(keep)] + [
        f"data.train={prompts_file}",
        "data.eval=0.3",  # more held-out prompts than a generation has completions
        "eval.generate=0",
        "finetune.objective=grpo",
        "finetune.rl.num_generations=4",
        "finetune.rl.max_completion_length=8",
        f"finetune.rl.reward_funcs=[{EVEN},accuracy]",
        "train.micro_batch_size=4",
        "train.grad_accum=2",
        "train.log_every=1",
        "train.max_steps=4",
    ]
