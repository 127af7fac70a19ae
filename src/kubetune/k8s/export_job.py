"""Render (pure): the merged-export Job the operator runs when training succeeded (and, for a
full fine-tune with an eval gate, the Job that only checks the gate before it is served).

One pod with the training image, the run's volume claim at /data and the trainers'
environment (caches, Hugging Face token), running `kubetune export RUN_DIR --merged`. It asks
for the CPU and memory of one worker (merging holds the base model in memory) and no
accelerator. No gang labels: it is one pod, scheduled alone.
"""

from __future__ import annotations

from kubetune.contracts.kube import KubeObject, drop_none
from kubetune.k8s import objects, profiles
from kubetune.k8s.names import Names
from kubetune.recipe.schema import Recipe

CONTAINER = "export"
BACKOFF_LIMIT = 2


def export_command(recipe: Recipe) -> list[str]:
    """With eval.gate, the Job exports only a run whose gate passed; with it or eval.tasks, it says
    the verdict and lm-eval's results in its termination message (contracts/gate.py), which the
    operator reads."""
    merged = ["--merged"] if recipe.finetune.method == "lora" else []  # a full run's Job checks the gate only
    gate = ["--gate"] if recipe.eval.gate is not None or recipe.eval.tasks else []
    return ["kubetune", "export", recipe.output_dir, *merged, *gate]


def _container(recipe: Recipe, names: Names) -> KubeObject:
    k8s = recipe.k8s
    worker = k8s.worker_resources()
    resources = {"cpu": str(worker["cpu"]), "memory": str(worker["memory"])}
    non_root = profiles.PROFILES[k8s.profile].non_root
    container = {
        "command": export_command(recipe),
        "env": objects.worker_env(recipe, names),
        "image": k8s.container_image(),
        "imagePullPolicy": k8s.image_pull_policy,
        "name": CONTAINER,
        "resources": {"limits": resources, "requests": dict(resources)},
        "securityContext": profiles.container_security(k8s) if non_root else None,
        "volumeMounts": [objects.data_mount()],
    }
    return drop_none(container)


def export_job(recipe: Recipe, names: Names, job_name: str) -> KubeObject:
    """`recipe` is the applied (resolved) recipe: its output_dir is on the claim."""
    k8s = recipe.k8s
    pod = {
        "containers": [_container(recipe, names)],
        "nodeSelector": dict(k8s.node_selector) or None,
        "restartPolicy": "Never",
        "securityContext": profiles.pod_security(k8s),
        "serviceAccountName": k8s.service_account,
        "tolerations": profiles.tolerations(k8s),
        "volumes": [objects.data_volume(names)],
    }
    meta = objects.object_meta(names, job_name, CONTAINER)
    template = {"metadata": {"labels": dict(meta["labels"])}, "spec": drop_none(pod)}
    spec = {"backoffLimit": BACKOFF_LIMIT, "template": template}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}
