"""Serving fixtures: two LoRA runs of the tiny Llama, and a real `kubetune serve` process on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kubetune.netutil import free_port, wait_ready
from tests.kit.paths import REPO


def train_tiny_run(out: Path, model_dir: Path, qa_file: Path, *extra: str) -> Path:
    from kubetune.training.run import train_from_recipe

    train_from_recipe(
        None,
        [
            f"model.name_or_path={model_dir}",
            f"data.train={qa_file}",
            "data.eval=0.25",
            "data.max_seq_len=64",
            f"data.cache_dir={out.parent / 'cache'}",
            "train.precision=fp32",
            "train.micro_batch_size=2",
            "train.grad_accum=1",
            "train.max_steps=2",
            "train.lr=5e-2",
            "train.warmup_steps=0",
            "eval.generate=0",
            "eval.max_samples=4",
            "lora.dropout=0.0",
            "train.num_threads=1",
            f"output_dir={out}",
            *extra,
        ],
    )
    return out


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path]:
    """(run a: LoRA r 4 on every linear layer, run b: LoRA r 8 on q/v), both over the tiny Llama."""
    import json

    root = tmp_path_factory.mktemp("serve-runs")
    qa = root / "qa.jsonl"
    qa.write_text(
        "".join(
            json.dumps({"instruction": "Answer truthfully", "input": f"What is {i} plus {i}?", "output": f"{2 * i}."})
            + "\n"
            for i in range(24)
        )
    )
    a = train_tiny_run(root / "run-a", tiny_model_dir, qa, "lora.r=4", "lora.target_modules=all-linear")
    b = train_tiny_run(root / "run-b", tiny_model_dir, qa, "lora.r=8", "lora.target_modules=[q_proj,v_proj]")
    return a, b


class ServerProcess:
    def __init__(self, args: list[str], timeout: float = 180, ready: Callable[[str], bool] | None = None) -> None:
        """`ready(url)`: when the server counts as started (default: /ready answers 200)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "kubetune", "serve", *args, "--port", str(self.port), "--threads", "1"]
        cmd += [] if "--engine" in args else ["--engine", "native"]
        # A file, not a pipe: nobody reads a pipe while the server runs, and a server that
        # writes more than the pipe holds (tracebacks of failed requests) would block on its
        # next write and hang every test that shares it.
        fd, log = tempfile.mkstemp(prefix="kubetune-serve-", suffix=".log")
        self.log = Path(log)
        with os.fdopen(fd, "w") as sink:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
        url = self.url
        wait_ready((lambda: ready(url)) if ready else f"{url}/ready", timeout, process=self.proc, log=self.log)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log.exists():  # a second stop() returns what the first read
            self.output = self.log.read_text(errors="replace")
            self.log.unlink()
        return self.output


def metric(values: dict, name: str, **labels: str) -> float:
    """The value of one sample (summed over the labels not given)."""
    return sum(v for (n, ls), v in values.items() if n == name and all((k, val) in ls for k, val in labels.items()))


@pytest.fixture(scope="session")
def tiny_server(tiny_runs):
    """One server for every module that only asks it questions (each start costs seconds);
    tests that change a server's state (drain, a full queue, flags) start their own."""
    a, b = tiny_runs
    server = ServerProcess([str(a), "--adapter", f"qv={b}", "--dtype", "fp32"])
    yield server
    server.stop()
