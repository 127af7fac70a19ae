"""A model whose class lives in its own code (`auto_map` in config.json, `model.trust_remote_code=true`)
through every command a user runs on it, each a real process started as from a shell:
`kubetune train` on its default path (the planner's memory check and its measurement in probe
processes, the launcher, two ranks), then `kubetune eval`, `generate` and `serve` on the run.

Every one of them must read the model through kubetune.models.load with the flag: a read
without it makes transformers ask on stdin, which these processes close (EOF: a traceback)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kubetune.training.processes import DIST_ENV

from .conftest import REPO, tiny_recipe, write_qa_file
from .serve.conftest import ServerProcess

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 300  # each command; the planner's measurement starts probe processes
PROMPT = "What is fact number 3?"

CONFIG_CODE = """from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
"""
MODEL_CODE = """from transformers import LlamaForCausalLM

from .configuration_tiny import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
"""


@pytest.fixture(scope="module")
def remote_code_model(tmp_path_factory, tiny_model_dir) -> Path:
    """The conftest's tiny Llama under a model type transformers does not know, whose config and
    model classes are in the directory's own .py files: it loads only with trust_remote_code."""
    out = tmp_path_factory.mktemp("tiny-remote")
    for f in tiny_model_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config.update(
        model_type="tiny_remote",
        architectures=["TinyRemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny.TinyRemoteConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyRemoteForCausalLM",
        },
    )
    (out / "config.json").write_text(json.dumps(config))
    (out / "configuration_tiny.py").write_text(CONFIG_CODE)
    (out / "modeling_tiny.py").write_text(MODEL_CODE)
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


def kubetune(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kubetune", *args],
        env=env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,  # a prompt for trust_remote_code reads EOF, as in a pod
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        preexec_fn=on_two_cores,
    )


def test_a_remote_code_model_trains_on_processes_evaluates_generates_and_serves(tmp_path, remote_code_model):
    run = tmp_path / "run"
    env = shell_env(tmp_path / "kubetune-cache")
    recipe = [
        o
        for o in tiny_recipe(remote_code_model, write_qa_file(tmp_path / "qa.jsonl"), tmp_path / "data-cache")
        if not o.startswith(("train.num_threads", "train.max_steps", "data.max_seq_len"))
    ]
    recipe += ["model.trust_remote_code=true", "train.max_steps=2", "data.max_seq_len=64", f"output_dir={run}"]

    trained = kubetune(["train", *recipe], env)
    assert trained.returncode == 0, trained.stderr[-4000:]
    # The tiny layer is all small operations, which threads cannot share: the measurement
    # picks the processes by far, and the ranks load the model's code too.
    assert re.search(r"kubetune: processes: 2 x .*per 1k tokens of a decoder layer", trained.stderr), trained.stderr
    assert "2 process(es) on cpu" in trained.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 2

    evaluated = kubetune(["eval", str(run)], env)
    assert evaluated.returncode == 0 and "perplexity" in evaluated.stdout, evaluated.stderr[-3000:]

    generated = kubetune(["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "4"], env)
    assert generated.returncode == 0, generated.stderr[-3000:]

    server = ServerProcess([str(run), "--dtype", "fp32"])
    try:
        answer = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={
                "model": run.name,
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 4,
                "temperature": 0,
            },
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"].strip() == generated.stdout.strip()
    finally:
        server.stop()
