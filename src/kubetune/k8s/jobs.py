"""The training job: PyTorchJob (kubeflow.org/v1), TrainJob and ClusterTrainingRuntime
(trainer.kubeflow.org/v1alpha1), as plain dicts; the TrainJob and runtime are round-tripped
through the Trainer SDK's models as a check of their shape."""

from __future__ import annotations

from kubetune.contracts.kube import KubeObject, drop_none
from kubetune.k8s import kueue
from kubetune.k8s.names import CONTAINER, KUEUE_LABEL, TRAIN_COMMAND, Names
from kubetune.k8s.objects import object_meta, tracking_env_from, worker_pod_template
from kubetune.recipe.k8s import K8sSection
from kubetune.recipe.schema import Recipe

# ------------------------------------------------------------------------------------- jobs


def _job_labels(k8s: K8sSection, names: Names) -> dict[str, str]:
    # With Volcano the queue is Volcano's (PodGroup/schedulingPolicy); otherwise it is Kueue's.
    return {KUEUE_LABEL: str(k8s.queue)} if kueue.queued(k8s) else {}


def _replica_specs(recipe: Recipe, names: Names) -> KubeObject:
    """Elastic: Workers only; else one Master and k8s.replicas - 1 Workers."""
    k8s = recipe.k8s

    def replicas(n: int) -> KubeObject:
        # OnFailure: a crashed container restarts in place and resumes from the last checkpoint.
        template = worker_pod_template(recipe, names, CONTAINER["pytorchjob"])
        return {"replicas": n, "restartPolicy": "OnFailure", "template": template}

    if k8s.elastic.enabled:
        return {"Worker": replicas(k8s.replicas)}
    specs = {"Master": replicas(1)}
    if k8s.replicas > 1:
        specs["Worker"] = replicas(k8s.replicas - 1)
    return specs


def _elastic_policy(k8s: K8sSection) -> KubeObject | None:
    if not k8s.elastic.enabled:
        return None
    lo, hi = k8s.elastic_range()
    return {"maxReplicas": hi, "maxRestarts": k8s.elastic.max_restarts, "minReplicas": lo, "rdzvBackend": "c10d"}


def _run_policy(k8s: K8sSection) -> KubeObject:
    scheduling = None
    if k8s.gang == "volcano":
        min_available = k8s.elastic_range()[0] if k8s.elastic.enabled else k8s.replicas
        scheduling = drop_none({"minAvailable": min_available, "priorityClass": k8s.priority_class, "queue": k8s.queue})
    # cleanPodPolicy Running: finished and failed pods stay for `logs` and `doctor`, while
    # pods still running when the job ends give their nodes back.
    return drop_none({"backoffLimit": k8s.backoff_limit, "cleanPodPolicy": "Running", "schedulingPolicy": scheduling})


def pytorchjob(recipe: Recipe, names: Names) -> KubeObject:
    k8s = recipe.k8s
    spec = {
        "elasticPolicy": _elastic_policy(k8s),
        "nprocPerNode": str(k8s.processes_per_pod()),
        "pytorchReplicaSpecs": _replica_specs(recipe, names),
        "runPolicy": _run_policy(k8s),
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": object_meta(names, names.job, "job", labels=_job_labels(k8s, names)),
        "spec": drop_none(spec),
    }


def _runtime_patch(recipe: Recipe, names: Names) -> KubeObject:
    """What the TrainJob adds to the runtime's `node` pods: volumes, mounts, placement, security."""
    pod = worker_pod_template(recipe, names, CONTAINER["trainjob"])
    spec = pod["spec"]
    container = spec["containers"][0]
    # Only the fields a v2.3 runtime patch accepts; image, command, env and resources travel
    # in spec.trainer, hostIPC / priority / scheduler in the runtime (see `cluster_runtime`).
    patch_spec = {
        k: spec[k]
        for k in ("volumes", "nodeSelector", "tolerations", "affinity", "securityContext", "serviceAccountName")
        if k in spec
    }
    patch_spec["containers"] = [
        {k: container[k] for k in ("name", "volumeMounts", "securityContext") if k in container}
    ]
    replicated = {"name": "node", "template": {"spec": {"template": {"metadata": pod["metadata"], "spec": patch_spec}}}}
    return {"manager": "kubetune", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [replicated]}}}}


def trainjob(recipe: Recipe, names: Names, runtime_name: str) -> KubeObject:
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    k8s = recipe.k8s
    # the whole worker pod's container: its resources carry k8s.network's RDMA devices too
    container = worker_pod_template(recipe, names, CONTAINER["trainjob"])["spec"]["containers"][0]
    trainer = {
        "image": k8s.container_image(),
        "command": container["command"],
        "env": container["env"],
        "numNodes": k8s.replicas,
        "resourcesPerNode": container["resources"],
    }
    if k8s.nproc_per_node != "auto":
        trainer["numProcPerNode"] = int(k8s.nproc_per_node)
    meta = object_meta(names, names.job, "job", labels=_job_labels(k8s, names))
    job = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": meta,
        "spec": {
            "runtimeRef": {"name": runtime_name, "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime"},
            "trainer": trainer,
            "runtimePatches": [_runtime_patch(recipe, names)],
        },
    }
    # Round-trip through the Trainer SDK model: it fails loudly if the SDK disagrees on shape.
    checked: KubeObject = TrainerV1alpha1TrainJob.from_dict(job).to_dict()
    return checked


def cluster_runtime(recipe: Recipe, names: Names) -> KubeObject:
    """A ClusterTrainingRuntime carrying what a TrainJob cannot patch (hostIPC, priority, gang)."""
    from kubeflow_trainer_api.models import TrainerV1alpha1ClusterTrainingRuntime

    k8s = recipe.k8s
    pod = worker_pod_template(recipe, names, CONTAINER["trainjob"])["spec"]
    node = {"name": "node", "image": k8s.container_image(), "command": list(TRAIN_COMMAND)}
    # envFrom (monitor.tracking_env_from): spec.trainer carries env only, the runtime's container the rest
    pod_spec = {"containers": [drop_none({**node, "envFrom": tracking_env_from(recipe)})]}
    # resourceClaims (k8s.devices=dra): a runtime patch cannot add them; spec.trainer's
    # resourcesPerNode.claims names them for the container
    carried = ("hostIPC", "hostNetwork", "dnsPolicy", "priorityClassName", "schedulerName", "resourceClaims")
    pod_spec.update({k: pod[k] for k in carried if k in pod})
    spec: KubeObject = {
        "mlPolicy": {"numNodes": k8s.replicas, "torch": {}},
        "template": {
            "spec": {
                "replicatedJobs": [
                    {
                        "name": "node",
                        # The Trainer injects spec.trainer (image, command, env, resources) into this step.
                        "template": {
                            "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                            "spec": {"template": {"spec": pod_spec}},
                        },
                    }
                ]
            }
        },
    }
    if k8s.gang == "coscheduling":
        spec["podGroupPolicy"] = {"coscheduling": {"scheduleTimeoutSeconds": 600}}
    elif k8s.gang == "volcano":
        spec["podGroupPolicy"] = {"volcano": {}}
    framework = {"trainer.kubeflow.org/framework": "torch"}
    meta = object_meta(names, names.runtime, "runtime", namespaced=False, labels=framework)
    obj = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "ClusterTrainingRuntime",
        "metadata": meta,
        "spec": spec,
    }
    checked: KubeObject = TrainerV1alpha1ClusterTrainingRuntime.from_dict(obj).to_dict()
    return checked
