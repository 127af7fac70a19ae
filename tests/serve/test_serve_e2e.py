"""The real SmolLM2-135M behind `kubetune serve`: the server's greedy answers are exactly
`kubetune generate`'s, and 16 concurrent requests answer as each does alone."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kubetune.serve.generate import generate_cli
from tests.kit.paths import SHARED_DATA

from .conftest import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.process]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    from kubetune.training.run import train_from_recipe

    root = tmp_path_factory.mktemp("real-serve")
    train_from_recipe(None, [
        "train.max_steps=1", "train.micro_batch_size=2", "train.grad_accum=1", "train.precision=fp32",
        "train.lr=2e-3", "data.max_seq_len=128", "data.max_train_samples=8", "eval.max_samples=2",
        "eval.generate=0", f"data.cache_dir={root / 'cache'}", f"output_dir={root / 'smol'}",
    ])  # fmt: skip
    return root / "smol"


@pytest.fixture(scope="module")
def server(real_run):
    server = ServerProcess([str(real_run), "--dtype", "fp32"], timeout=300)
    yield server
    server.stop()


def _questions(n: int) -> list[str]:
    path = SHARED_DATA / "test.jsonl"
    if not path.is_file():
        return [f"What is the normal range of value number {i} in a blood test?" for i in range(n)]
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    return [r.get("input") or r.get("instruction") for r in rows]


def _ask(client: openai.OpenAI, model: str, question: str) -> str:
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, temperature=0
    )
    return r.choices[0].message.content or ""


def test_greedy_answers_equal_kubetune_generate(server, real_run, smollm_dir):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
    question = "What does insulin do?"
    adapter = generate_cli(str(real_run), question, max_new_tokens=MAX_TOKENS)
    base = generate_cli(str(smollm_dir), question, max_new_tokens=MAX_TOKENS)
    assert _ask(client, real_run.name, question).strip() == adapter
    assert _ask(client, "smollm2-135m-instruct", question).strip() == base


@pytest.mark.slow  # CI: test_engine's batched mixed-adapter equality and test_lora_batch's greedy text cover it
def test_sixteen_concurrent_greedy_requests_answer_as_each_alone(server, real_run):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=600)
    questions = _questions(16)
    models = [real_run.name if i % 2 else "smollm2-135m-instruct" for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda qm: _ask(client, qm[1], qm[0]), zip(questions, models)))
    alone = [_ask(client, m, q) for q, m in zip(questions, models)]
    assert together == alone
    assert len(set(together)) > 8
