"""Contract test: the rendered PyTorchJob, run as the training operator would run it.

For each replica we take the container's command and env from the rendered manifest, add
what the Kubeflow training operator injects (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK,
PET_*), map the ConfigMap mount (/etc/kubetune) and the PVC (/data) to temporary
directories, and start it as a real process on loopback. The job must train to the end
with its checkpoints on the "PVC"; a replica killed mid-run (and the job restarted, as
restartPolicy OnFailure does) must resume from the last checkpoint, not from zero.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from kubetune.k8s.render import render
from kubetune.netutil import free_port
from kubetune.recipe import load_recipe
from tests.kit.processes import wait_for_checkpoint

pytestmark = pytest.mark.multiproc


@pytest.fixture
def pod_world(tmp_path, tiny_model_dir, qa_file):
    """A fake node: the PVC (/data) holding the model and data, and a recipe that uses them."""
    pvc = tmp_path / "pvc"
    shutil.copytree(tiny_model_dir, pvc / "models" / "tiny")
    (pvc / "datasets").mkdir(parents=True)
    shutil.copy(qa_file, pvc / "datasets" / "qa.jsonl")
    recipe = load_recipe(
        None,
        [
            "model.name_or_path=/data/models/tiny",
            "data.train=/data/datasets/qa.jsonl",
            "data.eval=0.25",
            "data.max_seq_len=128",
            "train.precision=fp32",
            "train.micro_batch_size=2",
            "train.grad_accum=1",
            "train.max_steps=8",
            "train.save_every=2",
            "train.lr=1e-2",
            "train.warmup_steps=1",
            "eval.generate=0",
            "eval.max_samples=8",
            "lora.dropout=0.0",
            "output_dir=/data/runs/contract",
            "k8s.replicas=2",
            "k8s.name=contract",
        ],
    ).recipe
    return tmp_path, pvc, recipe


def _mounted_recipe(etc: Path, config_map: dict, pvc: Path, metrics_port: int | None) -> Path:
    """The ConfigMap as one pod mounts it. Each pod has its own network namespace, so all serve
    metrics on the same port; replicas sharing one host get a port of their own instead."""
    etc.mkdir(exist_ok=True)
    for key, text in config_map["data"].items():
        data = yaml.safe_load(text.replace("/data/", f"{pvc}/"))
        if metrics_port is not None:
            data["monitor"]["port"] = metrics_port
        (etc / key).write_text(yaml.safe_dump(data, sort_keys=False))
    return etc


def _replica_processes(
    tmp_path: Path,
    pvc: Path,
    recipe,
    metrics_ports: list[int] | None = None,
    master_addr: str = "127.0.0.1",
    objects: list[dict] | None = None,
) -> list[tuple[list[str], dict]]:
    """The job's replicas as processes, from `objects` (default: what `render(recipe)` makes)."""
    objs = {o["kind"]: o for o in (objects or render(recipe).objects)}
    job = objs["PyTorchJob"]
    port = str(free_port())
    specs = job["spec"]["pytorchReplicaSpecs"]
    ranks = [("Master", 0)] + [("Worker", i) for i in range(specs.get("Worker", {}).get("replicas", 0))]
    world = len(ranks)
    procs = []
    for rank, (rtype, _index) in enumerate(ranks):
        port_here = metrics_ports[rank] if metrics_ports else None
        etc = _mounted_recipe(tmp_path / f"etc-kubetune-{rank}", objs["ConfigMap"], pvc, port_here)

        def mapped(s: str, etc: Path = etc) -> str:
            return s.replace("/etc/kubetune", str(etc)).replace("/data", str(pvc))

        container = next(c for c in specs[rtype]["template"]["spec"]["containers"] if c["name"] == "pytorch")
        command = [mapped(a) for a in container.get("command", []) + container.get("args", [])]
        assert command[0] == "kubetune", command
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PET_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "KUBETUNE_"))
        }
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = mapped(e["value"])
        # What the training operator injects (reference §1); the Service name becomes loopback.
        env.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=port,
            WORLD_SIZE=str(world),
            RANK=str(rank),
            PET_MASTER_ADDR=master_addr,
            PET_MASTER_PORT=port,
            PET_NNODES=str(world),
            PET_NODE_RANK=str(rank),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
        )
        if job["spec"].get("nprocPerNode"):
            env["PET_NPROC_PER_NODE"] = job["spec"]["nprocPerNode"]
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
        procs.append(([sys.executable, "-m", "kubetune", *command[1:]], env))
    return procs


def _start(procs, cwd):
    return [
        subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in procs
    ]


@pytest.mark.slow  # CI: test_distributed's killed worker resumes, the two-namespace test runs the rendered contract
def test_rendered_pytorchjob_trains_and_a_killed_replica_resumes(pod_world):
    tmp_path, pvc, recipe = pod_world
    metrics_ports = [free_port(), free_port()]
    procs = _replica_processes(tmp_path, pvc, recipe, metrics_ports)
    assert len(procs) == 2
    run = pvc / "runs" / "contract"

    pods = _start(procs, tmp_path)
    wait_for_checkpoint(run, 4, *pods)
    # every pod serves its metrics where the rendered PodMonitor scrapes them (port `metrics`)
    for port in metrics_ports:
        assert "kubetune_train_step" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    pods[1].send_signal(signal.SIGKILL)  # the worker pod dies
    pods[1].wait()
    try:  # the master loses its peer: its collective fails and the container exits non-zero
        pods[0].wait(timeout=180)
    except subprocess.TimeoutExpired:
        pods[0].kill()
        pods[0].wait()
    assert not (run / "summary.json").exists()

    # restartPolicy OnFailure: the operator restarts the containers with the same command and env.
    restarted = _start(_replica_processes(tmp_path, pvc, recipe, metrics_ports), tmp_path)
    outs = [p.communicate(timeout=300)[0] for p in restarted]
    assert all(p.returncode == 0 for p in restarted), [o[-3000:] for o in outs]
    assert "resumed from" in outs[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    # the tokenized-data cache lives on the PVC too (KUBETUNE_CACHE=/data/cache)
    assert any((pvc / "cache").rglob("offsets.npy"))
    assert yaml.safe_load((run / "recipe.yaml").read_text())["output_dir"] == f"{pvc}/runs/contract"


@pytest.mark.slow  # test_distributed's two-host test runs the same env contract across namespaces in CI
def test_rendered_pytorchjob_across_two_network_namespaces(pod_world, two_hosts):
    """The same job with each replica on its own 'node' (a network namespace): the worker
    reaches the master only through the master's address, as the headless Service gives it."""
    tmp_path, pvc, recipe = pod_world
    recipe = recipe.model_copy(update={"train": recipe.train.model_copy(update={"max_steps": 3})})
    procs = _replica_processes(tmp_path, pvc, recipe, master_addr=two_hosts[0][1])
    pods = []
    for (cmd, env), (ns, _addr, ifname) in zip(procs, two_hosts):
        env = {**env, "GLOO_SOCKET_IFNAME": ifname}
        pods.append(
            subprocess.Popen(
                ["ip", "netns", "exec", ns, *cmd],
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in pods]
    assert all(p.returncode == 0 for p in pods), [o[-3000:] for o in outs]
    assert json.loads((pvc / "runs" / "contract" / "summary.json").read_text())["steps"] == 3
