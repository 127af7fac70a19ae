"""The end-to-end claim of monitoring, on real kubetune processes: a real Prometheus (Debian's
2.42) scrapes a 2-process training run (`kubetune train --nproc-per-node 2`, DDP over gloo,
checkpoints and evaluations on), a real `kubetune serve` with an adapter under load, and a real
scheduler extender answering calls, through the monitors kubetune renders; then every PromQL
expression of every dashboard panel and every alert signal must return finite data.

What is not a kubetune process here is replayed by the replay exporter (samples.py, which says
where its samples come from): the device plugin (it needs a kubelet to register with), DCGM
and Intel's Gaudi exporter (no GPU or Gaudi here), node-exporter and cAdvisor.

With KUBETUNE_DASHBOARD_PNG_DIR set, the dashboards are also rendered to PNG from this data
(the pictures docs/monitoring/ shows come from this test).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kubetune.cluster.manifests import ComponentSettings, component_monitors
from kubetune.monitor.dashboards import dashboards
from kubetune.monitor.rules import rule_file
from kubetune.netutil import free_port
from tests.kit.cli import run_cli_redirected
from tests.kit.paths import REPO

from ..cluster.samples import extender_args, gaudi_node, training_pod
from ..serve.conftest import ServerProcess, tiny_runs  # noqa: F401 (tiny_runs: a fixture used below)
from .promtest import running_prometheus, scrape_job
from .test_prometheus import operator_job

# slow: CI's test_prometheus holds every panel and alert to data in a real Prometheus, and
# test_telemetry / tests/serve/test_metrics the real processes' series; this is their union
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
JOB, NS = "e2e", "kubetune"
PNG_DIR = os.environ.get("KUBETUNE_DASHBOARD_PNG_DIR")


def kubetune_process(log: Path, *args: str) -> subprocess.Popen:
    """`kubetune ARGS` writing to `log` (a pipe nobody reads would fill and stall the run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update({"PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"})
    with open(log, "wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "kubetune", *args], env=env, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT
        )


def stop(proc: subprocess.Popen) -> None:
    """The process and every process it started (torchrun's workers)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
    proc.kill()
    proc.wait(timeout=60)


def rendered_monitors(tmp: Path) -> tuple[dict, dict]:
    """The job's PodMonitor and the server's ServiceMonitor, as `kubetune monitor render` writes them."""
    out = tmp / "objects"
    result = run_cli_redirected(
        "monitor",
        "render",
        "-o",
        str(out),
        "--recipe",
        "smollm2-135m-lora-cpu",
        f"k8s.name={JOB}",
        f"k8s.namespace={NS}",
    )
    assert result.code == 0, result.err
    docs = [d for p in sorted(out.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    return next(d for d in docs if d["kind"] == "PodMonitor"), next(d for d in docs if d["kind"] == "ServiceMonitor")


def on_node(job: dict, node: str) -> dict:
    """A static target as the pod of `node` (what Kubernetes discovery would say)."""
    job["static_configs"][0]["labels"]["__meta_kubernetes_pod_node_name"] = node
    return job


def step_of(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url, timeout=2).text
    except httpx.HTTPError:
        return -1
    steps = [
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "kubetune_train_step"
    ]
    return min(steps) if len(steps) == 2 else -1


def keep_driving(server: ServerProcess, extender_url: str, done: threading.Event) -> None:
    while not done.wait(0.3):
        drive(server, extender_url)


def drive(server: ServerProcess, extender_url: str) -> None:
    """One round of traffic: a streamed chat on the base and on the adapter, a completion, and a
    scheduler call (so the latency histograms have observations inside the rate window)."""
    for model in ("run-a", "qv"):
        body = {"model": model, "messages": [{"role": "user", "content": "What is 2 plus 2?"}], "max_tokens": 8}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            r.read()
    httpx.post(f"{server.url}/v1/completions", json={"model": "run-a", "prompt": "1 2 3", "max_tokens": 4}, timeout=60)
    nodes = [gaudi_node("a", free=8), gaudi_node("b", free=2)]
    assert httpx.post(f"{extender_url}/filter", json=extender_args(training_pod(cards=8), nodes), timeout=10).is_success


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_model_dir, tiny_runs, replay_exporter):  # noqa: F811 (pytest's fixture argument)
    tmp = tmp_path_factory.mktemp("live")
    pod_monitor, service_monitor = rendered_monitors(tmp)
    plugin, extender_monitor = component_monitors(ComponentSettings())
    qa = tiny_runs[0].parent / "qa.jsonl"
    train_port, extender_port = free_port(), free_port()
    started = time.time()
    training = kubetune_process(
        tmp / "train.log",
        "train", "--nproc-per-node", "2", f"model.name_or_path={tiny_model_dir}", f"data.train={qa}",
        "data.eval=0.25", "data.max_seq_len=64", f"data.cache_dir={tmp / 'cache'}", "train.precision=fp32",
        "train.micro_batch_size=1", "train.max_steps=5000", "train.save_every=5", "train.eval_every=5",
        "eval.generate=0", "eval.max_samples=4", f"monitor.port={train_port}", f"output_dir={tmp / JOB}",
    )  # fmt: skip
    extender = kubetune_process(
        tmp / "extender.log", "scheduler-extender", "--host", "127.0.0.1", "--port", str(extender_port)
    )
    a, b = tiny_runs
    server = ServerProcess([str(a), "--adapter", f"qv={b}", "--dtype", "fp32"])
    extender_url = f"http://127.0.0.1:{extender_port}"
    url = replay_exporter.url
    jobs = [
        on_node(operator_job(pod_monitor, f"http://127.0.0.1:{train_port}/metrics"), "node-a"),
        operator_job(service_monitor, f"{server.url}/metrics"),
        on_node(operator_job(plugin, url("/deviceplugin")), "node-a"),
        operator_job(extender_monitor, f"{extender_url}/metrics"),
        scrape_job("dcgm-exporter", url("/dcgm")),
        scrape_job("gaudi-metric-exporter", url("/gaudi")),
        scrape_job("node-exporter", url("/node")),
        scrape_job("kubelet", url("/cadvisor")),
    ]
    rules = tmp / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule_file(), sort_keys=False))
    done = threading.Event()
    traffic = threading.Thread(target=keep_driving, args=(server, extender_url, done), daemon=True)
    try:
        with running_prometheus(tmp / "prometheus", jobs, (rules,)) as prom:
            traffic.start()  # all along, so that every latency histogram has observations in its rate window
            deadline = time.monotonic() + 300
            while step_of(f"http://127.0.0.1:{train_port}/metrics") < 12:  # two checkpoints and evaluations
                assert training.poll() is None, (tmp / "train.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "training did not reach step 12"
                time.sleep(0.5)
            prom.wait_for_scrapes(samples=4, timeout=60)
            if PNG_DIR:  # pictures for the docs: a minute and a half of data
                time.sleep(max(0.0, started + 90 - time.time()))
            yield prom, started
    finally:
        done.set()
        traffic.join(timeout=60)
        stop(training)
        stop(extender)
        server.stop()


def test_every_panel_and_alert_signal_has_data_from_real_processes(live):
    prom, _ = live
    empty = prom.expressions_without_data()
    assert not empty, "\n".join(empty)


def test_the_training_series_are_the_jobs_two_ranks(live):
    prom, _ = live
    series = prom.query("kubetune_train_step")
    assert {(s["metric"]["job"], s["metric"]["rank"], s["metric"]["node"]) for s in series} == {
        (JOB, "0", "node-a"),
        (JOB, "1", "node-a"),
    }
    (reduced,) = prom.query('sum(kubetune_collective_seconds_count{op="all_reduce"})')
    assert float(reduced["value"][1]) > 0


@pytest.mark.skipif(not PNG_DIR, reason="KUBETUNE_DASHBOARD_PNG_DIR not set (test_prometheus renders to PNG)")
def test_the_dashboards_render_from_this_data(live):
    from kubetune.monitor.snapshot import render_panels_png

    prom, started = live
    out = Path(str(PNG_DIR))
    out.mkdir(parents=True, exist_ok=True)
    for dashboard in dashboards():
        png = render_panels_png(prom.url, dashboard, out, started, time.time(), {"__rate_interval": "15s"}, step=1)
        assert png.read_bytes()[:4] == b"\x89PNG"
