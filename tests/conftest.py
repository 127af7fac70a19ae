"""Shared fixtures: a tiny randomly initialised Llama with the real SmolLM2 tokenizer.

The tokenizer comes from the embedded default model (converted once into the kubetune
cache), so templates, EOS handling and chat formatting are the real ones, while the model
is 2 layers x 32 dims and trains in milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from tests.kit.models import save_tiny_model
from tests.kit.paths import REPO, SHARED_DATA
from tests.kit.skips import pytest_configure as pytest_configure  # an unexpected skip fails the run

__all__ = ["REPO", "SHARED_DATA"]  # the tests' `from ..conftest import REPO`


# Keep tests off the user's cache only where it matters (run dirs); the converted model
# is shared with the user's cache on purpose: converting it costs ~20 s.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The suite draws the same property-test examples on every run, so that CI is reproducible and
# a failure seen once is seen again; `pytest --hypothesis-profile=explore` draws new ones (and
# prints the seed of a failure) to look for bugs the fixed draw misses.
settings.register_profile("suite", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("suite")


# Fixtures that start a server (a `kubetune serve` process, two network namespaces, the
# operator under kopf's KopfRunner): every test that uses one is a `process` test too.
PROCESS_FIXTURES = frozenset({"tiny_server", "two_hosts", "operator", "mlflow_tracking_server"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marks added here must count
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`process` also on the tests that start several processes (`multiproc`) and on those that
    use a fixture that starts a server, so that `-m "not process"` leaves every one out."""
    for item in items:
        uses = PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if uses or item.get_closest_marker("multiproc"):
            item.add_marker(pytest.mark.process)


@pytest.fixture(scope="session")
def mlflow_tracking_server(tmp_path_factory):
    """One real MLflow tracking server for the session (its start-up takes tens of seconds)."""
    from tests.kit.trackers import mlflow_server

    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    from kubetune.models.load import resolve_model

    return Path(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tokenizer(smollm_dir):
    from kubetune.models.load import load_tokenizer

    return load_tokenizer(str(smollm_dir))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    """The suite's tiny Llama (tests/kit/models.py) with the real SmolLM2 tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer)


def write_qa_file(path: Path) -> Path:
    """The 48 question/answer rows every tiny recipe trains on, as JSONL at `path`."""
    rows = [
        {
            "instruction": "Answer this question truthfully",
            "input": f"What is fact number {i}?",
            "output": f"Fact number {i} is that {i} plus {i} equals {2 * i}.",
        }
        for i in range(48)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def qa_file(tmp_path) -> Path:
    return write_qa_file(tmp_path / "qa.jsonl")


@pytest.fixture
def tiny_overrides(tiny_model_dir, qa_file, tmp_path) -> list[str]:
    """`tiny_recipe` in this test's directory."""
    return tiny_recipe(tiny_model_dir, qa_file, tmp_path / "cache")


def tiny_recipe(model_dir: Path, qa_file: Path, cache_dir: Path) -> list[str]:
    """A fast recipe: tiny model, 48 rows, fp32 (exact comparisons), a few steps (the
    `tiny_overrides` fixture; module fixtures that train once for several tests call it)."""
    return [
        f"model.name_or_path={model_dir}",
        f"data.train={qa_file}",
        "data.eval=0.25",
        "data.max_seq_len=128",
        f"data.cache_dir={cache_dir}",
        "train.precision=fp32",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "train.max_steps=6",
        "train.lr=1e-2",
        "train.warmup_steps=1",
        "train.save_every=2",
        "eval.generate=1",
        "eval.max_new_tokens=8",
        "eval.max_samples=8",
        "lora.dropout=0.0",
        "train.num_threads=1",
    ]


def for_processes(overrides: list[str]) -> list[str]:
    """`tiny_recipe` for several processes: 4 steps, grad_accum and threads set per test."""
    return [o for o in overrides if not o.startswith(("train.grad_accum", "train.num_threads"))] + [
        "eval.generate=0",
        "train.max_steps=4",
    ]


def load_bench(script: str):
    """bench/SCRIPT.py (e.g. "serve/serve_load") as a module named by its file, as a script run by path sees itself."""
    import importlib.util

    name = Path(script).name
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def resumed_here(overrides: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """Rerun a stopped run in this process: `train_from_recipe`, what `kubetune train` runs
    without a launcher (only the stop needs a process of its own); it must say where it
    resumed from."""
    import logging

    from kubetune.training.run import train_from_recipe

    with caplog.at_level(logging.INFO, logger="kubetune"):
        train_from_recipe(None, overrides)
    assert any(r.getMessage().startswith("resumed from") for r in caplog.records), caplog.text[-3000:]


def _ip(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Two hosts made of network namespaces joined by a veth pair (10.231.<n>.1 and .2)."""
    import shutil

    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    tag = f"kt{os.getpid() % 100000}"
    hosts = [f"{tag}a", f"{tag}b"]
    subnet = f"10.231.{os.getpid() % 250}"
    made = []
    try:
        for h in hosts:
            res = _ip("netns", "add", h)
            if res.returncode != 0:
                pytest.skip(f"the kernel refused a network namespace: `ip netns add` said: {res.stderr.strip()}")
            made.append(h)
        steps = [
            ("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb"),
            ("link", "set", f"{tag}va", "netns", hosts[0]),
            ("link", "set", f"{tag}vb", "netns", hosts[1]),
            ("-n", hosts[0], "addr", "add", f"{subnet}.1/24", "dev", f"{tag}va"),
            ("-n", hosts[1], "addr", "add", f"{subnet}.2/24", "dev", f"{tag}vb"),
            ("-n", hosts[0], "link", "set", f"{tag}va", "up"),
            ("-n", hosts[1], "link", "set", f"{tag}vb", "up"),
            ("-n", hosts[0], "link", "set", "lo", "up"),
            ("-n", hosts[1], "link", "set", "lo", "up"),
        ]
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                pytest.skip(f"the kernel refused `ip {' '.join(step)}`: {res.stderr.strip()}")
        yield [(hosts[0], f"{subnet}.1", f"{tag}va"), (hosts[1], f"{subnet}.2", f"{tag}vb")]
    finally:
        for h in made:
            _ip("netns", "del", h)
