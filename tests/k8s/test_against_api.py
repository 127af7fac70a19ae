"""submit / status / logs / doctor / delete through the CLI, the real kubernetes client and
real loopback HTTP, against kmock's in-memory Kubernetes API (see conftest.py)."""

from __future__ import annotations

import base64

import pytest

from .conftest import TOKEN

RECIPE = "smollm2-135m-lora-cpu"
JOB = "smollm2-135m-lora-cpu"
NS = "kubetune"


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "hf-token"
    path.write_text(TOKEN + "\n")
    return path


def _submit(cli, token_file, *extra):
    return cli("k8s", "submit", RECIPE, "--hf-token-file", str(token_file), *extra)


def _pod(name, rank_labels, phase="Running", statuses=None, node="node-a"):
    labels = {"app.kubernetes.io/instance": JOB, "app.kubernetes.io/component": "trainer", **rank_labels}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"containers": [{"name": "pytorch", "image": "img"}], "nodeName": node},
        "status": {"phase": phase, "containerStatuses": statuses or []},
    }


def _master(**kw):
    return _pod(
        f"{JOB}-master-0",
        {"training.kubeflow.org/replica-type": "master", "training.kubeflow.org/replica-index": "0"},
        **kw,
    )


def _worker(i, **kw):
    return _pod(
        f"{JOB}-worker-{i}",
        {"training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": str(i)},
        **kw,
    )


def test_submit_creates_every_object_in_one_namespace_then_is_idempotent(cli, kube, token_file):
    first = _submit(cli, token_file)
    assert first.code == 0, first.err
    assert "created PyTorchJob kubetune/smollm2-135m-lora-cpu" in first.out
    assert "unchanged Namespace kubetune" in first.out
    jobs = kube.objects("kubeflow.org/v1/pytorchjobs")
    assert list(jobs) == [(NS, JOB)]
    for plural in ("v1/configmaps", "v1/secrets", "v1/persistentvolumeclaims", "v1/pods"):
        assert [ns for ns, _ in kube.objects(plural)] == [NS], plural
    secret = kube.objects("v1/secrets")[(NS, f"{JOB}-hf-token")]
    assert base64.b64decode(secret["data"]["HF_TOKEN"]).decode() == TOKEN
    assert TOKEN not in first.out + first.err

    again = _submit(cli, token_file)
    assert again.code == 0, again.err
    actions = [line.split()[0] for line in again.out.splitlines() if not line.startswith("follow")]
    assert set(actions) == {"unchanged"}, again.out


def test_submit_updates_what_changed_and_keeps_immutable_pods(cli, kube, token_file):
    assert _submit(cli, token_file).code == 0
    changed = _submit(cli, token_file, "k8s.replicas=3", "k8s.image=registry.example/kubetune:2")
    assert changed.code == 0, changed.err
    assert "configured PyTorchJob kubetune/smollm2-135m-lora-cpu" in changed.out
    assert "kept Pod kubetune/smollm2-135m-lora-cpu-data" in changed.out  # a pod cannot change in place
    job = kube.objects("kubeflow.org/v1/pytorchjobs")[(NS, JOB)]
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2


def test_submit_refuses_a_recipe_that_changes_what_a_submitted_job_learns(cli, kube, token_file):
    # seen: submitting again with another learning rate printed `configured ConfigMap`, and the pods
    # stopped at their next start on "a finished run of a different recipe" (RunDir.claim)
    assert _submit(cli, token_file, "train.lr=1e-4").code == 0
    recipe_key = (NS, f"{JOB}-recipe")
    before = kube.objects("v1/configmaps")[recipe_key]["data"]["recipe.yaml"]

    refused = _submit(cli, token_file, "train.lr=2e-4")

    assert refused.code == 2 and refused.out == "", refused.out
    (line,) = [line for line in refused.err.splitlines() if line.startswith("kubetune: error:")]
    assert "changing train.lr (0.0001 -> 0.0002) changes what is learned" in line
    assert "give the new recipe a job of its own (another output_dir=... or k8s.name=...)" in line
    assert f"or `kubetune k8s delete {JOB} -n {NS} --purge` first" in line
    assert kube.objects("v1/configmaps")[recipe_key]["data"]["recipe.yaml"] == before  # nothing was sent
    # what keeps the run resumable goes through (the operator's rule: rundir.changed_keys)
    longer = _submit(cli, token_file, "train.lr=1e-4", "train.max_steps=500")
    assert longer.code == 0 and f"configured ConfigMap {NS}/{JOB}-recipe" in longer.out, longer.err
    assert _submit(cli, token_file, "train.lr=2e-4", "k8s.name=smollm2-lr-2e-4").code == 0  # a job of its own


def test_submit_trainjob_with_runtime(cli, kube, token_file):
    result = _submit(cli, token_file, "--api", "trainjob", "--with-runtime")
    assert result.code == 0, result.err
    assert list(kube.objects("trainer.kubeflow.org/v1alpha1/trainjobs")) == [(NS, JOB)]
    assert list(kube.objects("trainer.kubeflow.org/v1alpha1/clustertrainingruntimes")) == [(None, f"{JOB}-runtime")]


def test_status_shows_conditions_pods_by_rank_and_progress_from_the_rank0_log(cli, kube, token_file):
    assert _submit(cli, token_file).code == 0
    client = kube.client()
    client.patch(
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": JOB, "namespace": NS},
            "status": {
                "conditions": [
                    {"type": "Created", "status": "True"},
                    {"type": "Running", "status": "True", "message": "job is running"},
                ]
            },
        }
    )
    client.create(_worker(0, phase="Pending", node=None))
    client.create(_master())
    kube.script_log(
        f"{JOB}-master-0",
        "loading model\n"
        "kubetune: train  11%|█         | 11/100 [00:09<05:00, 1.10s/it, loss=1.5000, lr=2.00e-04, tokens=1000, "
        "tok/s=800.0]\n"
        "kubetune: train  12%|█▏        | 12/100 [00:10<01:20, 1.10s/it, loss=1.2345, lr=2.00e-04, tokens=12345, "
        "tok/s=850.2]\n",
    )
    result = cli("k8s", "status", JOB)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0] == f"PyTorchJob {NS}/{JOB}: Running"
    rows = [line for line in lines if line.split()[0] in ("0", "1")]
    assert rows[0].split()[:3] == ["0", f"{JOB}-master-0", "Running"]  # ordered by rank, not by name
    assert rows[1].split()[:3] == ["1", f"{JOB}-worker-0", "Pending"]
    assert "progress: step 12/100 (12%)  loss 1.2345  lr 2.00e-04  tok/s 850.2  eta 1m20s  (from rank-0 log)" in lines


def test_logs_default_to_rank_zero(cli, kube, token_file):
    assert _submit(cli, token_file).code == 0
    kube.client().create(_master())
    kube.client().create(_worker(0))
    kube.script_log(f"{JOB}-master-0", "I am rank 0\n")
    kube.script_log(f"{JOB}-worker-0", "I am rank 1\n")
    assert cli("k8s", "logs", JOB).out == "I am rank 0\n"
    assert cli("k8s", "logs", JOB, "--rank", "1").out == "I am rank 1\n"
    assert cli("k8s", "logs", JOB, "-f").out == "I am rank 0\n"
    follows = [r.params.get("follow") for r in list(kube.emulator) if r.subresource == "log"]
    assert follows == ["false", "false", "true"]
    missing = cli("k8s", "logs", JOB, "--rank", "5")
    assert missing.code == 2 and "no pod of rank 5" in missing.err


def test_doctor_reads_scheduling_events_and_oomkilled_pods(cli, kube, token_file):
    assert _submit(cli, token_file).code == 0
    client = kube.client()
    client.create(_worker(0, phase="Pending", node=None))
    client.create(
        _master(
            statuses=[
                {
                    "name": "pytorch",
                    "restartCount": 2,
                    "state": {"running": {}},
                    "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
                }
            ]
        )
    )
    kube.script_log(f"{JOB}-master-0", "step\n")
    client.create(
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": "ev1", "namespace": NS},
            "reason": "FailedScheduling",
            "type": "Warning",
            "involvedObject": {"kind": "Pod", "name": f"{JOB}-worker-0", "namespace": NS},
            "message": "0/3 nodes are available: 3 Insufficient cpu. preemption: 0/3 nodes are available.",
        }
    )
    result = cli("k8s", "doctor", JOB)
    assert result.code == 1  # findings of severity error
    assert f"[error] pod {JOB}-worker-0: Pending: not enough cpu on any node" in result.out
    assert "lower k8s.resources.cpu (now None)" not in result.out
    assert f"[error] pod {JOB}-master-0: OOMKilled" in result.out
    assert "train.micro_batch_size (now 4)" in result.out  # read from the submitted recipe ConfigMap


def test_doctor_healthy_job_has_no_findings(cli, kube, token_file):
    assert _submit(cli, token_file).code == 0
    client = kube.client()
    client.patch(
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": JOB, "namespace": NS},
            "status": {"conditions": [{"type": "Running", "status": "True"}]},
        }
    )
    client.create(_master())
    kube.script_log(f"{JOB}-master-0", "kubetune: train  10%|█         | 1/10 [00:01<00:09, 1.00s/it, loss=2.0000]\n")
    pvc = f"{JOB}-data"
    client.patch(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": pvc, "namespace": NS},
            "status": {"phase": "Bound"},
        }
    )
    result = cli("k8s", "doctor", JOB)
    assert result.code == 0, result.out
    assert "[info] job smollm2-135m-lora-cpu: no problems found" in result.out


def test_delete_keeps_the_pvc_unless_purge(cli, kube, token_file):
    assert _submit(cli, token_file).code == 0
    kube.client().create(_master())
    result = cli("k8s", "delete", JOB)
    assert result.code == 0, result.err
    assert kube.objects("kubeflow.org/v1/pytorchjobs") == {}
    assert kube.objects("v1/secrets") == {}
    assert list(kube.objects("v1/persistentvolumeclaims")) == [(NS, f"{JOB}-data")]
    assert list(kube.objects("v1/pods")) == [(NS, f"{JOB}-data")]  # trainer pod gone, data pod kept
    purged = cli("k8s", "delete", JOB, "--purge")
    assert purged.code == 0
    assert kube.objects("v1/persistentvolumeclaims") == {} and kube.objects("v1/pods") == {}
    assert cli("k8s", "delete", JOB).out.strip() == f"nothing named {JOB} in namespace {NS}"


def test_purge_never_deletes_an_existing_claim(cli, kube, token_file):
    client = kube.client()
    client.create(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "team-nfs", "namespace": NS},
            "spec": {},
        }
    )
    assert _submit(cli, token_file, "k8s.storage.existing_claim=team-nfs").code == 0
    assert cli("k8s", "delete", JOB, "--purge").code == 0
    assert list(kube.objects("v1/persistentvolumeclaims")) == [(NS, "team-nfs")]


def test_status_of_a_missing_job_is_one_line(cli, kube):
    result = cli("k8s", "status", "nope")
    assert result.code == 2
    assert result.err.count("\n") == 1 and "no PyTorchJob or TrainJob named nope in namespace kubetune" in result.err


def test_forbidden_is_one_clear_line(cli, kube):
    import kmock

    (
        kube.emulator["get", kmock.resource("kubeflow.org", "v1", "pytorchjobs")]
        << 403
        << {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "code": 403,
            "reason": "Forbidden",
            "message": 'pytorchjobs.kubeflow.org "x" is forbidden: User "tester" cannot get resource',
        }
    )
    result = cli("k8s", "status", "x")
    assert result.code == 2
    assert result.err.count("\n") == 1
    assert "forbidden" in result.err and "RBAC" in result.err


def test_unreachable_api_server_is_one_line(cli, kube, tmp_path, monkeypatch):
    from kubetune.netutil import free_port

    port = free_port()  # a port nobody listens on
    config = kube.kubeconfig.read_text().replace(kube.url, f"http://127.0.0.1:{port}")
    (tmp_path / "dead").write_text(config)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "dead"))
    result = cli("k8s", "status", "x")
    assert result.code == 2 and result.err.count("\n") == 1
    assert "cannot reach the Kubernetes API" in result.err


def test_missing_kubeconfig_is_one_line(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    result = cli("k8s", "status", "x")
    assert result.code == 2 and result.err.count("\n") == 1
    assert "no Kubernetes configuration" in result.err
