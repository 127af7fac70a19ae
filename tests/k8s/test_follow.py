"""submit / status / logs / download / delete against a fake at kubetune's own client boundary."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from kubetune.errors import UserError
from kubetune.k8s import follow
from kubetune.k8s.render import render
from kubetune.kubeapi import ClusterError
from kubetune.recipe.loader import load_recipe

from .fakes import FakeClient, UnexpectedCall

JOB, NS = "smollm2-135m-lora-cpu", "kubetune"
OUT = f"/data/runs/{JOB}"


def _rendered(*overrides):
    return render(load_recipe("smollm2-135m-lora-cpu", list(overrides)).recipe, hf_token=None)


def _pod(name, labels, phase="Running"):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"app.kubernetes.io/instance": JOB, "app.kubernetes.io/component": "trainer", **labels},
        },
        "status": {"phase": phase},
    }


def test_submit_creates_the_namespace_when_missing_and_in_order():
    fake = FakeClient()
    lines = follow.submit(fake, _rendered())
    assert lines[0] == "created Namespace kubetune"
    assert [c[1] for c in fake.calls if c[0] == "create"] == [
        "Namespace",
        "PersistentVolumeClaim",
        "ConfigMap",
        "PodMonitor",
        "Pod",
        "PyTorchJob",
    ]


def test_submit_when_namespaces_cannot_be_read():
    fake = FakeClient(forbidden={"Namespace"})
    lines = follow.submit(fake, _rendered())
    assert lines[0] == "assumed present Namespace kubetune"
    assert ("create", "Namespace", "kubetune") not in fake.calls


def test_submit_of_a_finished_job_says_how_to_rerun():
    fake = FakeClient()
    rendered = _rendered()
    follow.submit(fake, rendered)
    job = dict(
        rendered.job,
        status={"conditions": [{"type": "Running", "status": "True"}, {"type": "Succeeded", "status": "True"}]},
    )
    fake._put(job)
    lines = follow.submit(fake, rendered)
    assert lines[-1].startswith(f"note: PyTorchJob {JOB} already finished (Succeeded)")


def test_status_falls_back_to_metrics_on_the_pvc():
    fake = FakeClient()
    follow.submit(fake, _rendered())
    fake._put(_pod(f"{JOB}-master-0", {"training.kubeflow.org/replica-type": "master"}, phase="Pending"))
    metrics = (
        "\n".join(
            json.dumps(
                {
                    "step": s,
                    "total_steps": 40,
                    "epoch": s / 40,
                    "loss": 2.0 - s / 100,
                    "lr": 1e-4,
                    "grad_norm": 1.0,
                    "tokens": s * 100,
                    "tokens_per_s": 50.0,
                    "elapsed_s": s * 2.0,
                }
            )
            for s in (1, 2, 10)
        )
        + '\n{"step": 11, "tot'
    )  # a half-written line is skipped
    fake.execs[(f"{JOB}-data", ("tail", "-n", "5", f"{OUT}/metrics.jsonl"))] = metrics.encode()
    st = follow.status(fake, JOB, NS)
    assert st.progress.step == 10 and st.progress.total_steps == 40
    assert st.progress.eta_s == pytest.approx(60.0)  # 2 s/step x 30 steps left
    assert st.lines[-1] == (
        "progress: step 10/40 (25%)  epoch 0.25  loss 1.9000  lr 1.00e-04  tok/s 50.0  eta 1m  (from metrics.jsonl)"
    )
    assert not any(c[0] == "pod_log" for c in fake.calls)  # a Pending pod has no log to read


def test_status_without_any_progress():
    fake = FakeClient()
    follow.submit(fake, _rendered())
    fake.execs[(f"{JOB}-data", ("tail", "-n", "5", f"{OUT}/metrics.jsonl"))] = ClusterError("no such file")
    st = follow.status(fake, JOB, NS)
    assert st.progress is None
    assert st.lines[0] == f"PyTorchJob {NS}/{JOB}: Pending (no conditions yet)"
    assert "no training pods yet" in "\n".join(st.lines)


def test_elastic_workers_are_ranked_from_zero():
    fake = FakeClient()
    follow.submit(fake, _rendered("k8s.elastic.enabled=true", "k8s.replicas=2"))
    for i in (1, 0):
        fake._put(
            _pod(
                f"{JOB}-worker-{i}",
                {"training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": str(i)},
            )
        )
    fake.logs[f"{JOB}-worker-0"] = "hello from worker 0"
    assert list(follow.logs(fake, JOB, NS, rank=0)) == ["hello from worker 0"]


def test_trainjob_pods_are_ranked_by_completion_index():
    fake = FakeClient()
    follow.submit(fake, _rendered("k8s.api=trainjob"))
    for i in (1, 0):
        fake._put(_pod(f"{JOB}-node-0-{i}-abcde", {"batch.kubernetes.io/job-completion-index": str(i)}))
    fake.logs[f"{JOB}-node-0-1-abcde"] = "rank one"
    assert list(follow.logs(fake, JOB, NS, rank=1)) == ["rank one"]
    assert ("pod_log", f"{JOB}-node-0-1-abcde", "node") in fake.calls


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _with_data_pod(phase="Running"):
    fake = FakeClient()
    follow.submit(fake, _rendered())
    pod = fake.get("v1", "Pod", f"{JOB}-data", NS)
    fake._put(dict(pod, status={"phase": phase}))
    return fake


def test_download_copies_the_run_directory(tmp_path):
    fake = _with_data_pod()
    weights = bytes(range(256)) * 64  # binary, not UTF-8: must survive the exec stream untouched
    fake.execs[(f"{JOB}-data", ("tar", "cf", "-", "-C", "/data/runs", JOB))] = _tar(
        {f"{JOB}/adapter/adapter_model.safetensors": weights, f"{JOB}/summary.json": b"{}"}
    )
    path = follow.download(fake, JOB, NS, tmp_path / "out")
    assert path == tmp_path / "out" / JOB
    assert (path / "adapter" / "adapter_model.safetensors").read_bytes() == weights
    assert (path / "summary.json").read_text() == "{}"


def test_download_refuses_paths_outside_the_target(tmp_path):
    fake = _with_data_pod()
    fake.execs[(f"{JOB}-data", ("tar", "cf", "-", "-C", "/data/runs", JOB))] = _tar({"../escaped.txt": b"x"})
    with pytest.raises(UserError, match="unreadable"):
        follow.download(fake, JOB, NS, tmp_path / "out")
    assert not (tmp_path / "escaped.txt").exists()


def test_download_needs_a_running_data_pod(tmp_path):
    fake = _with_data_pod(phase="Pending")
    with pytest.raises(UserError, match="data-access pod kubetune/smollm2-135m-lora-cpu-data is Pending"):
        follow.download(fake, JOB, NS, tmp_path)


def test_delete_only_purges_what_kubetune_made():
    fake = FakeClient()
    follow.submit(fake, _rendered())
    fake._put(_pod(f"{JOB}-master-0", {}))
    fake._put(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": f"{JOB}-data", "namespace": NS, "labels": {}},
        }
    )
    lines = follow.delete(fake, JOB, NS, purge=True)
    assert f"deleted PyTorchJob {NS}/{JOB}" in lines and f"deleted Pod {NS}/{JOB}-master-0" in lines
    assert not any("PersistentVolumeClaim" in line for line in lines)  # unlabelled: not ours


def test_the_fake_fails_loudly_on_unscripted_calls():
    fake = FakeClient()
    with pytest.raises(UnexpectedCall):
        fake.pod_log("nobody", NS)
    with pytest.raises(UnexpectedCall):
        fake.replace({})
