"""The serving benchmark's own parts (bench/serve/naive_server.py, bench/serve/serve_load.py) on loopback
with the tiny random Llama: the naive server answers chat requests, streaming and not, for
the base and its adapter; the load generator's closed-loop clients measure it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench.common import serving

from kubetune.netutil import free_port, wait_ready
from tests.conftest import load_bench
from tests.kit.paths import REPO, SHARED_DATA

pytestmark = pytest.mark.process

serve_load = load_bench("serve/serve_load")


@pytest.fixture(scope="module")
def tiny_adapter(tiny_model_dir, tmp_path_factory) -> Path:
    """A LoRA adapter with random (non-zero) B, so that it changes the model's answers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, cfg)
    out = tmp_path_factory.mktemp("tiny-adapter")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def naive(tiny_model_dir, tiny_adapter, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("naive") / "server.log"
    argv = [sys.executable, str(REPO / "bench" / "serve" / "naive_server.py"), "--model", str(tiny_model_dir)]
    argv += ["--served-name", "tiny", "--adapter", f"lora1={tiny_adapter}", "--port", str(port), "--dtype", "fp32"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=serve_load.server_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/ready", 120, process=proc, log=log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _post(url: str, body: dict):
    import httpx

    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60, trust_env=False)


def _stream(url: str, body: dict) -> list[dict]:
    import httpx

    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60, trust_env=False) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def test_models_lists_base_and_adapter_with_parent(naive):
    import httpx

    data = httpx.get(naive + "/v1/models", trust_env=False).json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("tiny", None), ("lora1", "tiny")]


@pytest.mark.parametrize("model", ["tiny", "lora1"])
def test_chat_streaming_and_not_give_the_same_greedy_answer(naive, model):
    msgs = [{"role": "user", "content": "What does insulin do?"}]
    body = {"model": model, "messages": msgs, "max_tokens": 8, "temperature": 0}
    r = _post(naive, body)
    assert r.status_code == 200, r.text
    full = r.json()
    assert full["object"] == "chat.completion"
    text = full["choices"][0]["message"]["content"]
    usage = full["usage"]
    assert 0 < usage["completion_tokens"] <= 8 and usage["prompt_tokens"] > 5
    assert full["choices"][0]["finish_reason"] in ("stop", "length")

    events = _stream(naive, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == {"done": True}
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e.get("choices", []))
    assert streamed == text
    assert events[-2]["choices"] == [] and events[-2]["usage"] == usage


def test_adapter_changes_the_answer(naive):
    body = {"messages": [{"role": "user", "content": "Name a bone."}], "max_tokens": 8, "temperature": 0}
    base = _post(naive, {**body, "model": "tiny"}).json()["choices"][0]["message"]["content"]
    tuned = _post(naive, {**body, "model": "lora1"}).json()["choices"][0]["message"]["content"]
    assert base != tuned


def test_unknown_model_and_bad_body_get_openai_errors(naive):
    r = _post(naive, {"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = _post(naive, {"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_load_generator_measures_the_naive_server(naive):
    prompts = ["What is a fever?", "What does the liver do?", "Define anemia."]
    level = asyncio.run(serving.run_level(naive, ["tiny", "lora1"], prompts, 2, 4, requests_per_client=2))
    assert level["requests"] == 4 and level["errors"] == 0
    assert level["usage_reported"] is True
    assert 0 < level["generated_tokens"] <= 16
    assert level["tokens_per_s"] > 0 and level["requests_per_s"] > 0
    assert 0 < level["ttft_p50_s"] <= level["e2e_p50_s"] <= level["e2e_p99_s"]
    assert set(level["per_model"]) == {"tiny", "lora1"}


def test_pure_parts():
    assert serving.percentile([], 50) is None
    assert serving.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert serving.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert serving.choose_dtype({"amx_bf16": True}, "auto")[0] == "bf16"
    assert serving.choose_dtype({"avx2": True}, "auto")[0] == "fp32"
    args = serve_load.parse_args(["--quick", "--arms", "naive"])
    assert args.concurrency == [1, 4] and args.max_tokens == 16 and args.arms == ["naive"]
    assert serve_load.rpc(args, 4) == 2
    full = serve_load.parse_args([])
    assert [serve_load.rpc(full, c) for c in full.concurrency] == [32, 8, 2, 2]
    test_file = SHARED_DATA / "test.jsonl"
    if test_file.is_file():
        prompts = serving.load_prompts(test_file)
        assert len(prompts) >= 100 and all(p.endswith("?") or len(p) > 10 for p in prompts)


def test_vllm_arm_runs_the_contract_command(tmp_path):
    args = serve_load.parse_args(["--arms", "vllm", "--vllm-venv", str(tmp_path / "nowhere")])
    spec = serve_load.vllm_arm(args, "/models/smol", 8123, "fp32")
    assert spec.argv[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert spec.argv[spec.argv.index("--dtype") + 1] == "float32"
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert spec.skip and "scripts/vllm_venv.sh" in spec.skip
    rec = serve_load.run_arm(spec, args, ["q"], tmp_path)
    assert rec["status"].startswith("not run: ")


def test_kubetune_arm_holds_adapters_only_for_the_mix(tmp_path):
    """Both engines run the main levels without adapters and the mix in a second server that
    holds them, so neither pays for adapters it is not asked for."""
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text('{"r": 16}')
    args = serve_load.parse_args(["--arms", "kubetune", "--run", str(tmp_path)])
    plain = serve_load.kubetune_arm(args, "/models/smol", 8123, "fp32")
    assert plain.name == "kubetune" and "--adapter" not in plain.argv and not plain.adapters
    lora = serve_load.kubetune_arm(args, "/models/smol", 8124, "fp32", lora=True)
    assert lora.name == "kubetune+lora" and lora.adapters == ["a1", "a2", "a3", "a4"]
    assert lora.argv.count("--adapter") == 4
