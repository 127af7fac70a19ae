"""`--engine vllm`: the command kubetune runs is tested everywhere; vLLM itself only where it
is installed (KUBETUNE_VLLM_PYTHON, e.g. .venv-vllm/bin/python from scripts/vllm_venv.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kubetune.contracts.serving import Adapter, vllm_argv, vllm_lora_rank
from kubetune.errors import UserError
from kubetune.netutil import free_port, wait_ready
from kubetune.serve.vllm_engine import VLLM_PYTHON_ENV, vllm_options, vllm_python
from tests.kit.cli import run_cli_subprocess

pytestmark = pytest.mark.process


def test_a_lora_run_maps_to_the_base_with_every_adapter(tiny_runs, tiny_model_dir):
    a, b = tiny_runs
    opts = vllm_options(str(a), [Adapter("qv", str(b))], "0.0.0.0", 8000, 1024, 32)
    argv = vllm_argv(opts)
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str(tiny_model_dir)
    assert argv[argv.index("--served-model-name") + 1] == tiny_model_dir.name  # the native engine's base name
    lora = argv[argv.index("--lora-modules") + 1 :]
    assert lora[:2] == [f"run-a={a / 'adapter'}", f"qv={b / 'adapter'}"]
    assert "--enable-lora" in argv and "--max-lora-rank" not in argv  # rank 8: vLLM's default (16) holds it
    assert argv[argv.index("--max-model-len") + 1] == "1024" and argv[argv.index("--max-num-seqs") + 1] == "32"


def test_trust_remote_code_reaches_vllm_for_a_model_directory_and_a_run_keeps_its_recipes(tiny_runs, tiny_model_dir):
    def argv(target: str, flag: bool) -> list[str]:
        return vllm_argv(vllm_options(target, [], "0.0.0.0", 8000, None, None, trust_remote_code=flag))

    assert "--trust-remote-code" in argv(str(tiny_model_dir), True)
    assert "--trust-remote-code" not in argv(str(tiny_model_dir), False)
    assert "--trust-remote-code" not in argv(str(tiny_runs[0]), True)  # its recipe: model.trust_remote_code=false


def test_max_lora_rank_is_the_smallest_vllm_accepts_above_its_default():
    assert [vllm_lora_rank(r) for r in (1, 8, 16, 17, 32, 33, 300, 321, 512)] == [
        None,
        None,
        None,
        32,
        32,
        64,
        320,
        512,
        512,
    ]
    with pytest.raises(UserError, match=r"lora.r 513: vLLM serves LoRA adapters of rank 512 at most"):
        vllm_lora_rank(513)


def test_a_rank_above_vllms_default_sizes_max_lora_rank_for_every_adapter(tiny_runs, tmp_path):
    """The largest rank among the run's and the other adapters' decides."""
    import shutil

    a, b = tiny_runs
    wide = tmp_path / "wide"
    shutil.copytree(b, wide)
    recipe = wide / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("r: 8", "r: 24"))
    argv = vllm_argv(vllm_options(str(a), [Adapter("wide", str(wide))], "0.0.0.0", 8000, None, None))
    assert argv[argv.index("--max-lora-rank") + 1] == "32"


def test_without_vllm_the_command_says_how_to_get_it(tiny_runs, tmp_path):
    env = {VLLM_PYTHON_ENV: str(tmp_path / "no-such-python")}
    r = run_cli_subprocess(["serve", str(tiny_runs[0]), "--engine", "vllm"], env=env, timeout=120)
    assert r.returncode == 2
    expected = (
        "kubetune: error: --engine vllm: vLLM is not installed here; install it (CPU: scripts/vllm_venv.sh, then "
        "KUBETUNE_VLLM_PYTHON=.venv-vllm/bin/python) or use --engine native"
    )
    assert r.stderr.strip().splitlines() == [expected]


@pytest.mark.skipif(vllm_python() is None, reason=f"vLLM is not installed (set {VLLM_PYTHON_ENV} to a python with it)")
def test_vllm_serves_a_model_directory_under_the_native_engines_name(tmp_path, tokenizer):
    """`kubetune serve DIR --engine vllm` execs vLLM's server, which answers under the name the
    native engine uses. (A tiny Llama with 64-dim heads: vLLM's CPU attention has no kernel
    for the 8-dim heads of the other tests' tiny model.)"""
    from tests.kit.models import save_tiny_model

    model_dir = save_tiny_model(
        tmp_path / "tiny-64",
        tokenizer,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    kubetune = str(Path(sys.executable).parent / "kubetune")
    cmd = [kubetune, "serve", str(model_dir), "--engine", "vllm", "--port", str(port), "--max-model-len", "512"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/v1/models", 600, process=proc, interval=1)
        ids = {m["id"] for m in httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"]}
        assert ids == {"tiny-64"}
        body = {"model": "tiny-64", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_auto_picks_native_without_vllm_and_for_templates_vllm_would_not_render(tiny_runs, tmp_path, monkeypatch):
    from kubetune.serve import vllm_engine

    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "none"))
    assert vllm_engine.auto_picks_vllm(str(tiny_runs[0])) == (False, "vLLM is not installed")
    fake = tmp_path / "python"
    fake.write_text("")
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(fake))
    assert vllm_engine.auto_picks_vllm(str(tiny_runs[0])) == (True, "vLLM is installed")  # chat template
    import shutil

    alpaca = tmp_path / "alpaca-run"
    shutil.copytree(tiny_runs[0], alpaca)
    recipe = alpaca / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("template: chat", "template: alpaca"))
    picked, why = vllm_engine.auto_picks_vllm(str(alpaca))
    assert not picked and "template" in why
