"""GRPO with its rollouts from a separate `kubetune serve` (finetune.rl.rollout = server), against
real server processes on loopback: the trainer pushes each version of its adapter, samples from
it by name, and trains on the exact token ids the server's engine sampled; a server that is not
there, cannot load adapters, or goes away mid-run stops the run with one line."""

from __future__ import annotations

import json
import math
import re
import time

import httpx
import pytest
import torch

from kubetune.contracts.serving import ROLLOUT_WAIT_ENV
from kubetune.errors import UserError
from kubetune.netutil import free_port
from kubetune.recipe import load_recipe
from kubetune.training.dist import DistEnv
from kubetune.training.rollout import LocalRollouts, RolloutSettings
from kubetune.training.rollout_server import ADAPTERS_DIR, RolloutServerError, ServerRollouts
from kubetune.training.run import train_from_recipe
from tests.kit.cli import run_cli_subprocess
from tests.kit.processes import communicate_or_fail, finish, start_kubetune, wait_for_checkpoint
from tests.serve.conftest import ServerProcess
from tests.training.test_grpo import assert_a_killed_run_resumes_exactly, records

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def rollout_server(tiny_model_dir):
    """`kubetune serve` of the tiny base model, as docs/rl.md starts it."""
    server = ServerProcess([str(tiny_model_dir), "--dtype", "fp32", "--allow-runtime-adapters"])
    yield server
    server.stop()


def _served(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def test_a_run_pushes_each_version_and_trains_on_the_servers_samples(tmp_path, grpo_overrides, rollout_server):
    url, out = rollout_server.url, tmp_path / "policy"
    args = ["finetune.rl.rollout=server", f"finetune.rl.server_url={url}", "train.max_steps=3", "train.save_every=0"]
    train_from_recipe(None, [*grpo_overrides, *args, f"output_dir={out}"])
    rows = records(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward"]) for r in rows)
    assert all(r["completions/mean_length"] > 0 for r in rows)
    # v0 (the starting adapter: eval before, step 1), then one version per optimizer step; the
    # server's log names each load, and each version but the last was unloaded after its last use
    log = rollout_server.log.read_text()
    loaded = re.findall(r"adapter (policy-step\d+) loaded", log)
    assert loaded == [f"policy-step{n}" for n in range(4)], log[-3000:]
    assert re.findall(r"adapter (policy-step\d+) unloaded", log) == [f"policy-step{n}" for n in range(3)]
    assert "policy-step3" in _served(url) and "policy-step2" not in _served(url)
    assert [p.name for p in (out / ADAPTERS_DIR).iterdir()] == ["v3"]  # earlier versions' files removed
    logged = [json.loads(ln) for ln in (out / "completions.jsonl").read_text().splitlines()]
    assert logged and all("reward" in row for row in logged)
    httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "policy-step3"}, timeout=30)


def test_the_server_samples_what_the_engine_in_process_samples(tmp_path, tiny_model_dir, tokenizer, rollout_server):
    """The same adapter, seeds and settings: the server's token ids and log-probs are the local engine's."""
    from kubetune.models.finetune import build_model

    recipe = load_recipe(None, [f"model.name_or_path={tiny_model_dir}", "train.precision=fp32"]).recipe
    torch.manual_seed(0)
    parts = build_model(recipe, str(tiny_model_dir), torch.device("cpu"))
    with torch.no_grad():  # LoRA's B starts at zero: give the adapter a say
        for name, p in parts.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    prompts = [(0, tokenizer("What is 2 + 2?")["input_ids"]), (5, tokenizer("Name a colour.")["input_ids"])]
    settings = RolloutSettings(max_tokens=10, temperature=1.0, seed=3)
    local = LocalRollouts(parts.lm, tokenizer.eos_token_id, lambda: torch.autocast("cpu", enabled=False), 64, 6)
    expected = local.sample(prompts, 3, settings, generation=2)
    remote = ServerRollouts(rollout_server.url, "same", parts.model, str(tiny_model_dir), tmp_path, DistEnv())
    got = remote.sample(prompts, 3, settings, generation=2)
    assert [c.tokens for c in got] == [c.tokens for c in expected]
    assert [c.prompt_index for c in got] == [0, 0, 0, 5, 5, 5] and [c.truncated for c in got] == [
        c.truncated for c in expected
    ]
    for a, b in zip(got, expected):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert "same-step0" in _served(rollout_server.url)
    remote.policy_at(1)  # an optimizer step later: the next sample pushes v1 and drops v0
    remote.sample(prompts[:1], 1, settings, generation=3)
    served = _served(rollout_server.url)
    assert "same-step1" in served and "same-step0" not in served
    remote.close()


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_sigkill_then_rerun_against_the_same_server_matches_the_uninterrupted_run(
    tmp_path, grpo_overrides, rollout_server
):
    """The resumed run samples what the uninterrupted one did: same seeds, same weights (the version
    a killed run left loaded on the server is replaced, not reused)."""
    server = ["finetune.rl.rollout=server", f"finetune.rl.server_url={rollout_server.url}"]
    assert_a_killed_run_resumes_exactly(tmp_path, [*grpo_overrides, *server, "train.save_every=2"], steps=5, kill_at=2)


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
@pytest.mark.multiproc
def test_two_processes_sample_from_one_server_as_one_process(tmp_path, grpo_overrides, rollout_server):
    """Rank 0 pushes each version while rank 1 waits; each samples its own prompts."""
    server = ["finetune.rl.rollout=server", f"finetune.rl.server_url={rollout_server.url}"]
    common = [o for o in grpo_overrides if not o.startswith(("train.grad_accum", "train.num_threads"))]
    common += [*server, "train.max_steps=3", "train.save_every=0"]
    one, two = tmp_path / "one", tmp_path / "two"
    train_from_recipe(None, [*common, "train.grad_accum=2", f"output_dir={one}"])
    out = finish(start_kubetune(["train", "--nproc-per-node", "2", *common, "train.grad_accum=1", f"output_dir={two}"]))
    assert "2 process(es)" in out
    for x, y in zip(records(one), records(two), strict=True):
        for key in ("loss", "reward", "reward_std", "completions/mean_length", "entropy", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), (key, x["step"])
    loaded = re.findall(r"adapter (two-step\d+) loaded", rollout_server.log.read_text())
    assert loaded == [f"two-step{n}" for n in range(4)]  # once per version, not once per process


def test_an_answer_from_another_policy_stops_the_run(tmp_path):
    """A server that answers for a model other than the version asked for (a shared server, an
    alias): one line, not a silent update from the wrong samples. A real HTTP server on loopback
    plays it: kubetune serve itself never answers for another model."""
    import http.server
    import threading

    class Other(http.server.BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"object": "list", "data": []})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/unload_lora_adapter":
                return self._send(404, {"error": {"message": "no adapter", "param": "lora_name"}})
            if self.path == "/v1/load_lora_adapter":
                return self._send(200, {})
            logprobs = {"tokens": ["token_id:7"], "token_logprobs": [-1.0]}
            choice = {"index": 0, "text": "x", "logprobs": logprobs, "finish_reason": "stop"}
            self._send(200, {"model": "someone-else-step0", "choices": [choice]})

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        model = _AdapterOnly()
        rollouts = ServerRollouts(f"http://127.0.0.1:{httpd.server_port}", "mine", model, "base", tmp_path, DistEnv())
        with pytest.raises(RolloutServerError, match="'someone-else-step0' where 'mine-step0'") as e:
            rollouts.sample([(0, [1, 2])], 1, RolloutSettings(max_tokens=4, temperature=1.0), generation=0)
        assert "\n" not in str(e.value) and model.saved
    finally:
        httpd.shutdown()


class _AdapterOnly:
    """What save_trained asks of a PEFT model, for the fake server above (it reads no files)."""

    saved = False

    def save_pretrained(self, where, safe_serialization):
        (where / "adapter_config.json").write_text("{}")
        self.saved = True


def test_the_server_serves_a_recipes_base_model_by_its_name(smollm_dir, tmp_path):
    """`kubetune serve <model.name_or_path>`: the embedded default (or a .gguf, a hub id) as training loads it."""
    from kubetune.serve.native.models import model_source

    assert model_source("smollm2-135m-instruct").path == smollm_dir
    with pytest.raises(UserError, match="neither"):
        model_source(str(tmp_path / "missing"))


def test_a_trainer_told_to_wait_waits_then_says_how_long(tmp_path, monkeypatch):
    monkeypatch.setenv(ROLLOUT_WAIT_ENV, "2")
    started = time.monotonic()
    with pytest.raises(RolloutServerError, match=r"no kubetune serve answers there in 2 s"):
        ServerRollouts(f"http://127.0.0.1:{free_port()}", "p", None, "base", tmp_path, DistEnv())
    assert time.monotonic() - started >= 2


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_no_server_at_the_url_is_one_line_before_step_1(tmp_path, grpo_overrides):
    url = f"http://127.0.0.1:{free_port()}"
    args = ["train", "--nproc-per-node", "1", *grpo_overrides, "finetune.rl.rollout=server"]
    done = run_cli_subprocess([*args, f"finetune.rl.server_url={url}", f"output_dir={tmp_path}/r"])
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [ln for ln in done.stderr.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1 and "finetune.rl.server_url" in lines[0] and "--allow-runtime-adapters" in lines[0]
    assert "Traceback" not in done.stderr and not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_server_without_runtime_adapters_is_refused(tmp_path, tiny_model_dir):
    server = ServerProcess([str(tiny_model_dir), "--dtype", "fp32"])
    try:
        with pytest.raises(RolloutServerError, match="--allow-runtime-adapters") as e:
            ServerRollouts(server.url, "p", None, str(tiny_model_dir), tmp_path, DistEnv())
        assert "\n" not in str(e.value) and isinstance(e.value, UserError)
    finally:
        server.stop()


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_a_server_that_dies_mid_run_stops_it_with_one_line_and_keeps_the_checkpoints(
    tmp_path, grpo_overrides, tiny_model_dir
):
    server = ServerProcess([str(tiny_model_dir), "--dtype", "fp32", "--allow-runtime-adapters"])
    out = tmp_path / "run"
    args = ["finetune.rl.rollout=server", f"finetune.rl.server_url={server.url}", "train.max_steps=200"]
    proc = start_kubetune(["train", "--nproc-per-node", "1", *grpo_overrides, *args, "train.save_every=1",
                           f"output_dir={out}"])  # fmt: skip
    try:
        wait_for_checkpoint(out, 1, proc)
    finally:
        server.stop()  # the server goes away while the run samples its next generations
    output, _ = communicate_or_fail(proc, 300)
    assert proc.returncode == 2, output[-3000:]
    lines = [ln for ln in output.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1 and "stopped answering" in lines[0] and "resume" in lines[0], output[-3000:]
    assert "Traceback" not in output
    assert (out / "checkpoints" / "step-1").is_dir()
