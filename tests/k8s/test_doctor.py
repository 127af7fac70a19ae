"""doctor's rules, one symptom at a time, on plain dicts (diagnose is pure)."""

from __future__ import annotations

import pytest

from kubetune.k8s.doctor import Snapshot, diagnose, report

JOB, NS = "run", "kubetune"
RECIPE = {
    "train": {"micro_batch_size": 8, "gradient_checkpointing": "off"},
    "parallel": {"timeout_s": 1800},
    "k8s": {
        "profile": "cpu",
        "amx_label": "feature.node.kubernetes.io/cpu-cpuid.AMXBF16",
        "node_selector": {},
        "resources": {"cpu": "200", "memory": "226Gi", "accelerators": 0, "hugepages_2mi": None},
    },
}


def job(conditions=(), suspend=None, labels=None, status=True):
    obj = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": JOB, "namespace": NS, "labels": labels or {}},
        "spec": {},
    }
    if suspend is not None:
        obj["spec"]["runPolicy"] = {"suspend": suspend}
    if status:
        obj["status"] = {"conditions": list(conditions)}
    return obj


def pod(name="run-master-0", phase="Running", **container_status):
    statuses = (
        [{"name": "pytorch", "image": "img:1", "restartCount": container_status.pop("restarts", 0), **container_status}]
        if container_status
        else []
    )
    return {"metadata": {"name": name}, "status": {"phase": phase, "containerStatuses": statuses}}


def scheduling(pod_name, message):
    return {"reason": "FailedScheduling", "involvedObject": {"kind": "Pod", "name": pod_name}, "message": message}


def findings(**snap):
    snap.setdefault("job", job([{"type": "Running", "status": "True"}]))
    snap.setdefault("recipe", RECIPE)
    return diagnose(Snapshot(name=JOB, namespace=NS, **snap))


def only(found):
    errors = [f for f in found if f.severity != "info"]
    assert len(errors) == 1, report(found)
    return errors[0]


@pytest.mark.parametrize(
    "resource,fix",
    [
        ("cpu", "lower k8s.resources.cpu (now 200)"),
        ("memory", "lower k8s.resources.memory (now 226Gi)"),
        ("habana.ai/gaudi", "check the device plugin runs"),
        ("nvidia.com/gpu", "lower k8s.resources.accelerators"),
        ("hugepages-2Mi", "pre-allocate 2Mi huge pages"),
    ],
)
def test_pending_for_insufficient_resources(resource, fix):
    message = (
        f"0/4 nodes are available: 4 Insufficient {resource}. "
        "preemption: 0/4 nodes are available: 4 No preemption victims found."
    )
    f = only(findings(pods=[pod(phase="Pending")], events=[scheduling("run-master-0", message)]))
    assert f.problem.startswith(f"Pending: not enough {resource} on any node")
    assert fix in f.fix


def test_several_reasons_in_one_event():
    message = "0/5 nodes are available: 2 Insufficient cpu, 3 Insufficient memory."
    found = findings(pods=[pod(phase="Pending")], events=[scheduling("run-master-0", message)])
    assert [f.problem.split(" (")[0] for f in found] == [
        "Pending: not enough cpu on any node",
        "Pending: not enough memory on any node",
    ]


def test_only_the_newest_scheduling_event_counts():
    old = scheduling("run-master-0", "0/2 nodes are available: 2 Insufficient memory.")
    new = scheduling("run-master-0", "0/2 nodes are available: 2 Insufficient cpu.")
    assert "cpu" in only(findings(pods=[pod(phase="Pending")], events=[old, new])).problem


def test_node_selector_and_amx_label_mismatch():
    message = "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."
    f = only(findings(pods=[pod(phase="Pending")], events=[scheduling("run-master-0", message)]))
    assert "no node matches" in f.problem
    assert "k8s.amx_label=null" in f.fix and "--show-labels" in f.fix


def test_untolerated_taint():
    message = "0/3 nodes are available: 3 node(s) had untolerated taint {dedicated: gpu}. preemption: not helpful"
    f = only(findings(pods=[pod(phase="Pending")], events=[scheduling("run-master-0", message)]))
    assert "taint {dedicated: gpu}" in f.problem and "key: dedicated, operator: Exists" in f.fix


def test_scheduling_events_of_running_pods_are_history():
    message = "0/3 nodes are available: 3 Insufficient cpu."
    assert findings(pods=[pod()], events=[scheduling("run-master-0", message)])[0].severity == "info"


def pvc(cls="nfs", phase="Pending"):
    return {
        "metadata": {"name": "run-data"},
        "spec": {"storageClassName": cls} if cls else {},
        "status": {"phase": phase},
    }


def pvc_event(message, reason="ProvisioningFailed"):
    return {
        "reason": reason,
        "involvedObject": {"kind": "PersistentVolumeClaim", "name": "run-data"},
        "message": message,
    }


def test_missing_storage_class():
    f = only(
        findings(
            pvc=pvc("nfs-fast"),
            storage_class_missing="nfs-fast",
            events=[pvc_event('storageclass.storage.k8s.io "nfs-fast" not found')],
        )
    )
    assert f.problem == "StorageClass nfs-fast does not exist"
    assert "k8s.storage.storage_class" in f.fix and "ReadWriteMany" in f.fix


def test_no_storage_class_and_no_default():
    f = only(
        findings(
            pvc=pvc(None),
            events=[
                pvc_event(
                    "no persistent volumes available for this claim and no storage class is set", reason="FailedBinding"
                )
            ],
        )
    )
    assert "no StorageClass is set" in f.problem and "k8s.storage.existing_claim" in f.fix


def test_storage_class_without_rwx():
    f = only(
        findings(
            pvc=pvc("ebs"),
            events=[
                pvc_event(
                    'failed to provision volume with StorageClass "ebs": '
                    "rpc error: access mode ReadWriteMany is not supported"
                )
            ],
        )
    )
    assert "cannot provide ReadWriteMany" in f.problem


def test_bound_pvc_is_fine():
    assert findings(pvc=pvc(phase="Bound"))[0].severity == "info"


def test_image_pull_backoff():
    f = only(
        findings(
            pods=[
                pod(
                    phase="Pending",
                    state={"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}},
                )
            ]
        )
    )
    assert f.problem.startswith("ImagePullBackOff: image img:1 cannot be pulled")
    assert "k8s.image" in f.fix and "imagePullSecret" in f.fix


def test_oomkilled_suggests_batch_checkpointing_and_memory():
    f = only(
        findings(
            pods=[
                pod(
                    state={"waiting": {"reason": "CrashLoopBackOff"}},
                    restarts=3,
                    lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}},
                )
            ]
        )
    )
    assert f.problem.startswith("OOMKilled") and "226Gi" in f.problem
    assert "train.micro_batch_size (now 8)" in f.fix
    assert "train.gradient_checkpointing=on (now off)" in f.fix and "k8s.resources.memory" in f.fix


def _oom_fix(train: dict, profile: str = "cpu") -> str:
    recipe = {**RECIPE, "train": train, "data": {"max_seq_len": 2048}, "k8s": {**RECIPE["k8s"], "profile": profile}}
    killed = pod(lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}}, state={"running": {}})
    return only(findings(pods=[killed], recipe=recipe)).fix


def test_oomkilled_never_suggests_a_lever_the_recipe_has_pulled():
    # seen: "set train.gradient_checkpointing=on (now on)"
    fix = _oom_fix({"micro_batch_size": 1, "gradient_checkpointing": "on"})
    assert "gradient_checkpointing=on" not in fix and "lower train.micro_batch_size" not in fix, fix
    assert fix.startswith("lower data.max_seq_len (now 2048; longer rows are truncated), or raise k8s.resources.memory")
    assert fix.endswith("(train.micro_batch_size is 1 and train.gradient_checkpointing is on already)")
    fix = _oom_fix({"micro_batch_size": 8, "gradient_checkpointing": "on_offload"})
    assert "lower train.micro_batch_size (now 8)" in fix and "gradient_checkpointing=on" not in fix, fix
    assert "data.max_seq_len" not in fix  # the batch-keeping lever comes first
    # on an accelerator the offloaded activations sit in the pod's memory, the one the limit caps
    on_gaudi = _oom_fix({"micro_batch_size": 1, "gradient_checkpointing": "on_offload"}, profile="gaudi")
    assert "set train.gradient_checkpointing=on (now on_offload: its offload fills the pod's memory)" in on_gaudi


def test_crash_loop_quotes_the_last_log_lines():
    f = only(
        findings(
            pods=[pod(state={"waiting": {"reason": "CrashLoopBackOff"}}, restarts=5)],
            logs={"run-master-0": ["loading", "Traceback (most recent call last):", "KeyError: 'text'"]},
        )
    )
    assert "after 5 restarts" in f.problem and "KeyError: 'text'" in f.problem
    assert "kubetune k8s logs run -n kubetune --rank N" in f.fix


def test_create_container_config_error():
    f = only(
        findings(
            pods=[
                pod(
                    phase="Pending",
                    state={
                        "waiting": {
                            "reason": "CreateContainerConfigError",
                            "message": 'configmap "run-recipe" not found',
                        }
                    },
                )
            ]
        )
    )
    assert "run-recipe" in f.problem and "submit" in f.fix


@pytest.mark.parametrize(
    "line",
    [
        "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError",
        (
            "torch.distributed.DistNetworkError: The client socket has timed out after 1800000ms "
            "while trying to connect to (run-master-0, 23456)."
        ),
        (
            "[W socket.cpp:464] [c10d] The client socket has timed out after 600s "
            "while trying to connect to (run-master-0, 23456)"
        ),
    ],
)
def test_rendezvous_timeouts(line):
    f = only(findings(pods=[pod()], logs={"run-master-0": ["start", line]}))
    assert f.problem.startswith("rendezvous failed") and "NetworkPolicies" in f.fix


@pytest.mark.parametrize(
    "line",
    [
        (
            "[rank1]:[E ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for 1800000 milliseconds before timing out."
        ),
        (
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.5]:23456: "
            "Connection reset by peer; Gloo timed out"
        ),
    ],
)
def test_collective_timeouts(line):
    f = only(findings(pods=[pod()], logs={"run-master-0": [line]}))
    assert f.problem.startswith("collective timeout") and "parallel.timeout_s (now 1800)" in f.fix


def test_failed_job():
    f = only(
        findings(
            job=job(
                [
                    {
                        "type": "Failed",
                        "status": "True",
                        "reason": "PyTorchJobFailed",
                        "message": "job run is failed because 1 Master replica(s) failed.",
                    }
                ]
            ),
            pods=[pod(phase="Failed")],
        )
    )
    assert f.problem.startswith("Failed: PyTorchJobFailed") and "kubetune k8s delete run" in f.fix


def test_no_operator():
    f = only(findings(job=job(status=False)))
    assert "no controller handles it" in f.problem and "training operator" in f.fix


def test_waiting_in_kueue():
    f = only(findings(job=job(suspend=True, labels={"kueue.x-k8s.io/queue-name": "team-a"})))
    assert f.severity == "warning" and "Kueue queue team-a" in f.problem and "localqueue team-a" in f.fix
    assert "its Workload could not be read" in f.problem  # Kueue's own conditions: tests/k8s/test_kueue.py


def test_oneccl_variables_in_the_pods_or_the_recipe():
    with_env = pod()
    with_env["spec"] = {"containers": [{"name": "pytorch", "env": [{"name": "CCL_WORKER_COUNT", "value": "4"}]}]}
    recipe = {**RECIPE, "comm": {"extra_env": {"I_MPI_PIN_DOMAIN": "socket"}}}
    f = only(findings(pods=[with_env], recipe=recipe))
    assert f.severity == "warning" and f.problem.endswith("are set: CCL_WORKER_COUNT, I_MPI_PIN_DOMAIN")
    assert "run on gloo" in f.fix and "comm.socket_ifname" in f.fix and "comm.threads_per_process" in f.fix
    assert "comm.affinity" in f.fix


def test_the_operators_exceeded_quota_event():
    event = {
        "reason": "FailedCreate",
        "involvedObject": {"kind": "PyTorchJob", "name": JOB},
        "message": 'Error creating: pods "run-worker-0" is forbidden: exceeded quota: team, requested: '
        "requests.cpu=200, used: requests.cpu=800, limited: requests.cpu=1000",
    }
    f = only(findings(events=[event]))
    assert f.problem.startswith("pods cannot be created: Error creating") and "exceeded quota: team" in f.problem
    assert "raise the quota" in f.fix


def test_missing_job():
    f = only(findings(job=None))
    assert f.problem == "no PyTorchJob or TrainJob run in kubetune"


def test_healthy():
    (f,) = findings(
        pods=[pod()],
        logs={"run-master-0": ["kubetune: train  10%|█         | 1/10 [00:01<00:09, 1.00s/it, loss=1.0000]"]},
    )
    assert (f.severity, f.problem) == ("info", f"no problems found in namespace {NS}")
    assert f.fix == f"`kubetune k8s status {JOB} -n {NS}`"


def test_report_format():
    lines = report(findings(job=None))
    assert lines[0] == "[error] job run: no PyTorchJob or TrainJob run in kubetune"
    assert lines[1].startswith("    fix: ")
