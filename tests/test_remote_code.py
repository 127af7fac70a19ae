"""A model whose class lives in its own code (`auto_map` in config.json, `model.trust_remote_code=true`)
through every command a user runs on it, each a real process started as from a shell:
`kubetune train` on its default path (the planner's memory check and its measurement in probe
processes, the launcher, two ranks), then `kubetune eval`, `generate` and `serve` on the run;
and `kubetune serve DIR` of the model directory itself, which has no recipe: `--trust-remote-code`.

Every one of them must read the model through kubetune.models.load with the flag: a read
without it makes transformers ask on stdin, which these processes close (EOF: a traceback)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kubetune.errors import ModelError
from kubetune.models.load import load_config
from kubetune.training.processes import DIST_ENV
from tests.kit.cli import run_cli_subprocess
from tests.kit.models import give_own_code
from tests.kit.processes import communicate_or_fail

from .conftest import REPO, tiny_recipe, write_qa_file
from .serve.conftest import ServerProcess

TIMEOUT_S = 300  # each command; the planner's measurement starts probe processes
PROMPT = "What is fact number 3?"


@pytest.fixture(scope="module")
def remote_code_model(tmp_path_factory, tiny_model_dir) -> Path:
    """The conftest's tiny Llama under a model type transformers does not know, whose config and
    model classes are in the directory's own .py files: it loads only with trust_remote_code."""
    out = tmp_path_factory.mktemp("tiny-remote")
    for f in tiny_model_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    give_own_code(out, "kubetune_own_code")
    return out


def shell_env(cache: Path) -> dict[str, str]:
    """A plain start from a shell (no launcher's or thread variables: the planner measures),
    with a kubetune cache of the test's own (no decision measured earlier is reused)."""
    env = {k: v for k, v in os.environ.items() if k not in (*DIST_ENV, "OMP_NUM_THREADS")}
    return {**env, "PYTHONPATH": str(REPO / "src"), "KUBETUNE_CACHE": str(cache)}


def on_two_cores() -> None:
    """The planner weighs one process per core: two here on any machine, so that the batch
    (2 rows x grad_accum 2) splits over them."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])


def kubetune(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kubetune", *args],
        env=env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,  # a prompt for trust_remote_code reads EOF, as in a pod
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=on_two_cores,
    )


def ended(proc: subprocess.Popen) -> tuple[str, str]:
    """stdout and stderr of a command that must succeed."""
    out, err = communicate_or_fail(proc, TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.args}:\n{err[-4000:]}"
    return out, err


def served_answer(run: Path) -> str:
    """`kubetune serve RUN`'s greedy answer to PROMPT, as `kubetune generate` answers it."""
    server = ServerProcess([str(run), "--dtype", "fp32"])
    try:
        question = {"role": "user", "content": PROMPT}
        body = {"model": run.name, "messages": [question], "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    finally:
        server.stop()
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


def test_only_models_load_reads_a_model_with_transformers():
    """The one loader: no other module of kubetune builds or reads a model, its config or its
    tokenizer through transformers' Auto classes (each such read must pass the recipe's
    revision and trust_remote_code, which models/load.py does in one place)."""
    src = REPO / "src" / "kubetune"
    readers = {
        f"{path.relative_to(src)}:{node.lineno}"
        for path in src.rglob("*.py")
        if path.relative_to(src).as_posix() != "models/load.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("transformers")
        and any(alias.name.startswith("Auto") for alias in node.names)
    }
    assert not readers, f"read a model through models/load.py instead: {sorted(readers)}"


def test_a_model_with_its_own_code_is_refused_in_one_line_without_the_flag(remote_code_model):
    names_both = r"its own code \(auto_map\).*model\.trust_remote_code=true in the recipe .*--trust-remote-code\)"
    with pytest.raises(ModelError, match=names_both):
        load_config(str(remote_code_model))
    assert type(load_config(str(remote_code_model), trust_remote_code=True)).__name__ == "TinyRemoteConfig"


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
@pytest.mark.multiproc
def test_a_remote_code_model_trains_on_processes_evaluates_generates_and_serves(tmp_path, remote_code_model):
    run = tmp_path / "run"
    env = shell_env(tmp_path / "kubetune-cache")
    recipe = tiny_recipe(remote_code_model, write_qa_file(tmp_path / "qa.jsonl"), tmp_path / "data-cache")
    recipe = [o for o in recipe if not o.startswith("train.num_threads")]  # threads set: nothing is measured
    recipe += ["model.trust_remote_code=true", "train.max_steps=2", "data.max_seq_len=64", "eval.generate=0"]

    _, log = ended(kubetune(["train", *recipe, f"output_dir={run}"], env))
    # The tiny layer is all small operations, which threads cannot share: the measurement
    # picks the processes by far, and the ranks load the model's code too.
    assert re.search(r"kubetune: processes: 2 x .*per 1k tokens of a decoder layer", log), log
    assert "2 process(es) on cpu" in log
    assert json.loads((run / "summary.json").read_text())["steps"] == 2

    # The readers of the run, side by side (each start is seconds of imports).
    readers = [
        kubetune(["eval", str(run)], env),
        kubetune(["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "4"], env),
    ]
    try:
        answer = served_answer(run)
        (evaluated, _), (generated, _) = (ended(p) for p in readers)
    finally:
        for p in readers:
            if p.poll() is None:
                p.kill()
    assert "perplexity" in evaluated
    assert answer.strip() == generated.strip()


@pytest.mark.process
def test_serving_the_model_directory_without_the_flag_says_which_flag_in_one_line(remote_code_model):
    r = run_cli_subprocess(["serve", str(remote_code_model), "--engine", "native", "--threads", "1"], timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "(kubetune serve DIR: --trust-remote-code)" in lines[0], r.stderr


@pytest.mark.process
def test_trust_remote_code_serves_the_model_directory(remote_code_model):
    server = ServerProcess([str(remote_code_model), "--dtype", "fp32", "--trust-remote-code"])
    try:
        body = {"model": remote_code_model.name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    finally:
        server.stop()
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] >= 1
