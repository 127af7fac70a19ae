"""One process with threads, or one single-thread process per core: when kubetune measures
it, how the batch is split, and that a run keeps the processes it started with."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest

from kubetune.data.packing import IGNORE
from kubetune.errors import ModelError
from kubetune.models import measure
from kubetune.models.load import model_config
from kubetune.models.measure import Decision
from kubetune.recipe import load_recipe
from kubetune.training import processes
from kubetune.training.checkpoint import CheckpointMeta, TrainState
from kubetune.training.processes import ProcessPlan, batch_split, plan_processes
from tests.kit.paths import REPO


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBETUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


@pytest.fixture
def free_threads(monkeypatch, tiny_overrides):
    """A plain start on a 2-core machine: no launcher, no thread settings."""
    for k in (*processes.DIST_ENV, "OMP_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(processes, "_cores", lambda: 2)
    return [o for o in tiny_overrides if not o.startswith("train.num_threads")]


def decided(choice: str) -> Decision:
    medians = {"threads": 2.0, "processes": 1.0}
    return Decision("processes", choice, medians, {k: (v, v) for k, v in medians.items()}, rounds=7)


def test_the_batch_split_keeps_the_rows_of_every_step():
    assert batch_split(micro=4, accum=2, n=2) == (4, 1)  # grad_accum first: the kernels' shapes stay
    assert batch_split(micro=2, accum=1, n=2) == (1, 1)
    assert batch_split(micro=4, accum=3, n=2) == (2, 3)
    assert batch_split(micro=3, accum=1, n=2) is None


def test_nothing_is_measured_where_threads_or_processes_are_given(free_threads, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("measured")

    monkeypatch.setattr(processes, "measure_processes", refuse)
    assert "threads set" in plan_processes(None, [*free_threads, "train.num_threads=2"]).why
    assert "names its own layout" in plan_processes(None, [*free_threads, "parallel.tp=2"]).why
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert plan_processes(None, free_threads).processes == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert plan_processes(None, free_threads) == ProcessPlan(1, why="started by a launcher")
    monkeypatch.delenv("LOCAL_RANK")
    uneven = plan_processes(None, [*free_threads, "train.micro_batch_size=3", "train.grad_accum=1"])
    assert uneven.processes == 1 and "neither divides by 2" in uneven.why


def test_the_measured_choice_decides_and_splits_the_batch(free_threads, monkeypatch, tmp_path):
    run = [*free_threads, f"output_dir={tmp_path / 'run'}"]  # tiny recipe: micro 2, grad_accum 2
    monkeypatch.setattr(processes, "measure_processes", lambda *a, **k: decided("processes"))
    plan = plan_processes(None, run)
    assert plan.processes == 2 and plan.overrides == ("train.micro_batch_size=2", "train.grad_accum=1")
    assert "processes 1.0 ms" in plan.describe()
    monkeypatch.setattr(processes, "measure_processes", lambda *a, **k: decided("threads"))
    assert plan_processes(None, run) == ProcessPlan(1, why=decided("threads").describe())


def test_a_run_resumes_with_the_processes_it_started_with(free_threads, monkeypatch, tmp_path):
    out = tmp_path / "run"
    step = out / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    meta = CheckpointMeta(TrainState(step=2), total_steps=6, seed=42, length=(6, 1.0), world_size=2)
    (step / "meta.json").write_text(json.dumps(meta.to_json()))
    monkeypatch.setattr(processes, "measure_processes", lambda *a, **k: decided("threads"))
    plan = plan_processes(None, [*free_threads, f"output_dir={out}"])
    assert plan.processes == 2 and "as the run in" in plan.why


def test_processes_are_not_tried_where_their_copies_would_not_fit(free_threads, monkeypatch, tmp_path):
    monkeypatch.setattr(processes, "_process_bytes", lambda recipe: float(1 << 50))
    monkeypatch.setattr(processes, "measure_processes", lambda *a, **k: decided("processes"))
    plan = plan_processes(None, [*free_threads, f"output_dir={tmp_path / 'run'}"])
    assert plan.processes == 1 and "GiB is free" in plan.why


def test_candidates_are_compared_per_unit_of_work():
    """N processes do N times the work of a call: they win when the work per second is higher."""
    now = [0.0]

    def costs(ms: float):
        def run(calls: int) -> None:
            now[0] += calls * ms / 1e3

        return run

    r = measure.race(
        {"threads": costs(100.0), "processes": costs(160.0)}, 5, lambda: now[0], {"threads": 1, "processes": 2}
    )
    assert r.median("processes") == pytest.approx(80.0) and r.median("threads") == pytest.approx(100.0)


def test_the_probe_gives_one_layer_its_share_of_the_head():
    assert processes.probe_vocab(SimpleNamespace(vocab_size=49152, num_hidden_layers=30)) == 2048  # one slice
    assert processes.probe_vocab(SimpleNamespace(vocab_size=128256, num_hidden_layers=16)) == 4 * 2048
    assert processes.probe_vocab(SimpleNamespace(vocab_size=1000, num_hidden_layers=2)) == 1000


def test_the_layer_workload_runs_the_head_on_the_targets(free_threads, monkeypatch):
    from kubetune.models import finetune

    recipe = load_recipe(None, free_threads).recipe
    config = model_config(recipe.model)
    spec = processes.LayerSpec(recipe.model_dump(mode="json"), config.to_dict())
    seen = []

    def head_loss(lm_head, hidden, labels):
        seen.append((lm_head.weight.shape[0], int((labels != IGNORE).sum())))
        return real(lm_head, hidden, labels)

    real = finetune.head_loss
    monkeypatch.setattr(finetune, "head_loss", head_loss)
    processes.layer_workload(spec, [5, 7], targets=6)(2)
    assert seen == [(processes.probe_vocab(config), 6)] * 2


@pytest.mark.multiproc
def test_a_real_measurement_times_the_layer_in_processes_and_is_kept(free_threads, cache, monkeypatch, tmp_path):
    recipe = load_recipe(None, [*free_threads, f"output_dir={tmp_path / 'run'}"]).recipe
    d = processes.measure_processes(recipe, 2, (2, 1))
    assert d.choice in ("threads", "processes") and set(d.medians) == {"threads", "processes"}
    assert all(m > 0 for m in d.medians.values()) and d.rounds >= measure.ROUNDS
    (path,) = cache.glob("processes-*.json")
    assert json.loads(path.read_text())["key"]["lora"]["r"] == recipe.lora.r

    def no_processes(self):
        raise AssertionError("started probe processes for a cached decision")

    monkeypatch.setattr(processes.WorkerPool, "__enter__", no_processes)
    again = processes.measure_processes(recipe, 2, (2, 1))
    assert again.cached and again.choice == d.choice and "cached" in again.describe()


def _env(cache_dir) -> dict[str, str]:
    """A plain start from a shell: no launcher's or thread variables, a cache of the test's own."""
    env = {k: v for k, v in os.environ.items() if k not in (*processes.DIST_ENV, "OMP_NUM_THREADS")}
    return {**env, "PYTHONPATH": str(REPO / "src"), "KUBETUNE_CACHE": str(cache_dir)}


@pytest.mark.multiproc
@pytest.mark.slow  # CI: the real measurement, the measured choice deciding the split, nproc auto's launch
def test_kubetune_train_runs_the_processes_it_measured(free_threads, tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "kubetune", "train", *free_threads, "eval.generate=0", f"output_dir={out}"]
    run = subprocess.run([*args, "train.max_steps=2"], capture_output=True, text=True, env=_env(tmp_path), cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    chosen = re.search(r"kubetune: processes: (\d) x .*per 1k tokens of a decoder layer", run.stderr)
    assert chosen, run.stderr[-2000:]
    assert f"{chosen.group(1)} process(es) on cpu" in run.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert len(list((tmp_path / "kernels").glob("processes-*.json"))) == 1


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
@pytest.mark.multiproc
def test_workers_die_with_their_agent(tiny_overrides, tmp_path):
    args = ["train", "--nproc-per-node", "2", *tiny_overrides, "train.max_steps=100000", "train.save_every=0"]
    agent = subprocess.Popen(
        [sys.executable, "-m", "kubetune", *args, "eval.generate=0", f"output_dir={tmp_path / 'run'}"],
        env=_env(tmp_path / "cache"),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert agent.stderr is not None
    for line in agent.stderr:  # the workers are training once one of them logs a step
        if "eval before" in line or "it/s" in line:
            break
    workers = psutil.Process(agent.pid).children(recursive=True)
    assert len(workers) >= 2
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait()
    gone, alive = psutil.wait_procs(workers, timeout=20)
    assert not alive and len(gone) == len(workers), f"workers outlived their agent: {[p.pid for p in alive]}"


def test_a_failed_measurement_trains_as_one_process_and_bad_input_stays_one_line(free_threads, monkeypatch, tmp_path):
    def broken(*a, **k):
        raise RuntimeError("a probe process stopped: no answer")

    monkeypatch.setattr(processes, "measure_processes", broken)
    plan = plan_processes(None, [*free_threads, f"output_dir={tmp_path / 'run'}"])
    assert plan.processes == 1 and "the measurement failed (a probe process stopped: no answer)" in plan.why

    def bad_input(*a, **k):
        raise ModelError("lora.target_modules: qkv_proj not in this model")

    monkeypatch.setattr(processes, "measure_processes", bad_input)
    with pytest.raises(ModelError, match=r"lora\.target_modules"):
        plan_processes(None, [*free_threads, f"output_dir={tmp_path / 'run'}"])
