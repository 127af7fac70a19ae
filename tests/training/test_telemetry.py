"""Training metrics (monitor.port) scraped from real training processes, and Kubeflow
progress pushed to a loopback HTTPS endpoint that checks the token and the body."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubetune.contracts.metrics import STEP_PHASES, TRAIN_METRICS, exposed_names
from kubetune.netutil import free_port
from kubetune.training.kubeflow_progress import KubeflowProgress, status_body
from tests.kit.cli import run_cli_in_process
from tests.kit.paths import REPO

pytestmark = pytest.mark.process


def scrape(port: int) -> dict[str, list]:
    """Samples by name from a /metrics endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def start_training(args: list[str], env_extra: dict | None = None) -> subprocess.Popen:
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("PET_", "MASTER_", "RANK"))}
    env.update({"PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", **(env_extra or {})})
    return subprocess.Popen(
        [sys.executable, "-m", "kubetune", "train", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def scrape_while_running(proc: subprocess.Popen, port: int, until_step: int) -> dict[str, list]:
    """The last scrape at which rank 0 had logged `until_step` (the run must still be going)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            samples = scrape(port)
        except OSError:
            time.sleep(0.2)
            continue
        steps = [s.value for s in samples.get("kubetune_train_step", [])]
        if steps and min(steps) >= until_step:
            return samples
        time.sleep(0.1)
    out = proc.communicate(timeout=60)[0] if proc.poll() is not None else ""
    pytest.fail(f"no scrape reached step {until_step}; training output:\n{out[-4000:]}")


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_two_ranks_serve_every_contract_metric_from_one_port(tmp_path, tiny_overrides):
    """kubetune's torchrun agent: local rank 0 serves both ranks (multiprocess mode), each
    series labelled with its rank; DDP's bucket all-reduces are timed."""
    port = free_port()
    overrides = [o for o in tiny_overrides if not o.startswith(("train.max_steps", "train.grad_accum"))]
    proc = start_training(
        [
            "--nproc-per-node",
            "2",
            *overrides,
            "train.max_steps=400",
            "train.grad_accum=1",
            "train.save_every=3",
            "eval.generate=0",
            f"monitor.port={port}",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    try:
        samples = scrape_while_running(proc, port, until_step=4)
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        out = proc.communicate(timeout=60)[0]
    assert f":{port}/metrics" in out and out.count("metrics: http://") == 1, out[-2000:]  # rank 0 says where
    for metric in TRAIN_METRICS:
        if metric.name == "kubetune_train_eval_loss":
            continue  # set by evaluations: the eval before training has run by then (below)
        if metric.name in ("kubetune_train_preference", "kubetune_train_rl"):
            continue  # preference objectives and GRPO only (tests/training/test_preference_train.py, test_grpo.py)
        name = exposed_names(metric)[0]
        ranks = {s.labels["rank"] for s in samples.get(name, [])}
        assert ranks == {"0", "1"}, f"{name}: ranks {ranks}"
    assert {s.labels["rank"] for s in samples["kubetune_train_eval_loss"]} == {"0", "1"}
    job = {s.labels["job"] for s in samples["kubetune_train_loss"]}
    assert job == {"run"}
    phases = {s.labels["phase"] for s in samples["kubetune_train_step_seconds_count"]}
    assert phases == set(STEP_PHASES) - {"rollout"}  # GRPO's
    reduced = [s for s in samples["kubetune_collective_seconds_count"] if s.labels["op"] == "all_reduce"]
    assert sum(s.value for s in reduced) > 0
    assert {s.labels["size_bucket"] for s in reduced} >= {"1KiB"}  # the step's scalar reductions
    assert sum(s.value for s in samples["kubetune_collective_bytes_total"]) > 1000  # gradient buckets
    mfu = [s.value for s in samples["kubetune_train_mfu_ratio"]]
    assert all(0 < v < 1 for v in mfu), mfu
    total = [s.value for s in samples["kubetune_train_total_steps"]]
    assert total == [400, 400]


def test_one_process_serves_and_a_taken_port_is_one_line(tmp_path, tiny_overrides, capfd):
    """`kubetune train` through kubetune.cli.main in this process (tests/test_cli_errors.py's
    real process shows a UserError from inside the run printed as its one line)."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["train", *tiny_overrides, f"monitor.port={port}", f"output_dir={tmp_path / 'busy'}"]
        res = run_cli_in_process(args, capfd)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert f"monitor.port {port}: cannot serve metrics" in out and "Traceback" not in out


# --------------------------------------------------------------------------- Kubeflow progress


class StatusEndpoint:
    """The Trainer's status endpoint on loopback HTTPS: checks the bearer token, keeps bodies."""

    def __init__(self, tmp_path: Path, token: str, answer: int = 200):
        import trustme

        self.ca = trustme.CA()
        cert = self.ca.issue_cert("127.0.0.1")
        self.ca_file = tmp_path / "ca.crt"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.token_file = tmp_path / "token"
        self.token_file.write_text(token + "\n")
        self.bodies: list[dict] = []
        self.rejected = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Authorization") != f"Bearer {endpoint.token_file.read_text().strip()}":
                    endpoint.rejected += 1
                    self.send_response(401)
                else:
                    endpoint.bodies.append(json.loads(body))
                    self.send_response(answer)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cert.configure_cert(context)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.path = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team/trainjobs/medical/status"
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}{self.path}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def env(self) -> dict[str, str]:
        return {
            "KUBEFLOW_TRAINER_SERVER_URL": self.url,
            "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(self.ca_file),
            "KUBEFLOW_TRAINER_SERVER_TOKEN": str(self.token_file),
        }


def test_training_pushes_progress_to_the_trainer_with_its_token(tmp_path, tiny_overrides, monkeypatch):
    """A run in this process (rank 0 of one) with the Trainer's variables set pushes its
    progress; the run returns only after the final push."""
    from kubetune.training.run import train_from_recipe

    endpoint = StatusEndpoint(tmp_path, token="projected-sa-token")
    for name, value in endpoint.env().items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    try:
        train_from_recipe(None, [*tiny_overrides, "train.max_steps=6", f"output_dir={tmp_path / 'run'}"])
    finally:
        endpoint.server.shutdown()
    assert endpoint.rejected == 0 and endpoint.bodies
    final = endpoint.bodies[-1]["trainerStatus"]
    assert final["progressPercentage"] == 100 and final["estimatedRemainingSeconds"] == 0
    metrics = {m["name"]: m["value"] for m in final["metrics"]}
    assert metrics["currentStep"] == "6" and metrics["totalSteps"] == "6"
    assert float(metrics["loss"]) > 0 and float(metrics["eval_loss"]) > 0
    assert all(isinstance(m["value"], str) for m in final["metrics"])
    assert final["lastUpdatedTime"].endswith("Z")
    # at most one push per 5 s, plus the final one
    assert len(endpoint.bodies) <= 2 + int(time.monotonic() - started) // 5


def test_a_failing_endpoint_is_said_once_and_never_raises(tmp_path, caplog):
    """A wrong token (401) and then no endpoint at all: every push fails on the pusher's own
    thread, the caller never sees an error, and the log says so once."""
    endpoint = StatusEndpoint(tmp_path, token="right")
    (tmp_path / "wrong").write_text("wrong")
    pusher = KubeflowProgress(endpoint.url, str(endpoint.ca_file), str(tmp_path / "wrong"))
    with caplog.at_level("WARNING", logger="kubetune"):
        pusher.update(10, 90, {"loss": 2.0})
        deadline = time.monotonic() + 10
        while not endpoint.rejected and time.monotonic() < deadline:
            time.sleep(0.05)
        endpoint.server.shutdown()
        endpoint.server.server_close()
        pusher.update(100, 0, {"loss": 1.0})
        pusher.close()
    assert endpoint.rejected == 1 and not endpoint.bodies
    warnings = [r.getMessage() for r in caplog.records if "kubeflow progress" in r.getMessage()]
    assert len(warnings) == 1 and "training goes on" in warnings[0], warnings


def test_pushes_are_throttled_and_the_last_status_wins(tmp_path):
    endpoint = StatusEndpoint(tmp_path, token="t")
    env = endpoint.env()
    pusher = KubeflowProgress(env["KUBEFLOW_TRAINER_SERVER_URL"], str(endpoint.ca_file), str(endpoint.token_file))
    try:
        for step in range(1, 51):
            pusher.update(2 * step, 50 - step, {"loss": 1.0 / step})
            time.sleep(0.01)
        pusher.close()
    finally:
        endpoint.server.shutdown()
    assert len(endpoint.bodies) == 2  # the first at once, then the newest when closing
    assert endpoint.bodies[-1]["trainerStatus"]["progressPercentage"] == 100
    assert status_body(140, -3, {})["trainerStatus"]["progressPercentage"] == 100
    assert status_body(10, -3, {})["trainerStatus"]["estimatedRemainingSeconds"] == 0
    assert KubeflowProgress.from_env({}) is None


def test_a_lone_process_exports_the_restart_count_its_checkpoint_carries():
    """A restarted pod's process continues the series (2 after two restarts), so increase()
    counts restarts across the counter resets of the container restarts."""
    from kubetune.training.telemetry import Identity, Telemetry, TrainMetrics

    metrics = TrainMetrics(Identity(job="j", rank=0, node="n"), multiprocess=False)
    telemetry = Telemetry(metrics, None, total_steps=10, world_size=1, flops_per_token=1.0, peak_flops=1.0)
    telemetry.started(step=4, epoch=0.5, resumes=2)
    labels = {"job": "j", "rank": "0", "node": "n"}
    assert metrics.registry.get_sample_value("kubetune_train_restarts_total", labels) == 2
    assert metrics.registry.get_sample_value("kubetune_train_progress_ratio", labels) == 0.4


def test_a_run_in_this_process_frees_its_port_and_observer(tmp_path, tiny_overrides):
    from kubetune.training import dist
    from kubetune.training.run import train_from_recipe

    port = free_port()
    args = [*tiny_overrides, "train.max_steps=2", "eval.generate=0", f"monitor.port={port}"]
    train_from_recipe(None, [*args, f"output_dir={tmp_path / 'run'}"])
    assert dist._observer is None
    with socket.socket() as s:
        s.bind(("0.0.0.0", port))  # a second run here could serve on it again
