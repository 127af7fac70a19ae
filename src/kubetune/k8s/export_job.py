"""Render (pure): the merged-export Job the operator runs when training succeeded.

One pod with the training image, the run's volume claim at /data and the trainers'
environment (caches, Hugging Face token), running `kubetune export RUN_DIR --merged`. It asks
for the CPU and memory of one worker (merging holds the base model in memory) and no
accelerator. No gang labels: it is one pod, scheduled alone.
"""

from __future__ import annotations

from kubetune.contracts.kube import KubeObject
from kubetune.k8s import objects, profiles
from kubetune.k8s.names import DATA_DIR, Names
from kubetune.recipe.schema import Recipe

CONTAINER = "export"
BACKOFF_LIMIT = 2


def export_command(recipe: Recipe) -> list[str]:
    return ["kubetune", "export", recipe.output_dir, "--merged"]


def export_job(recipe: Recipe, names: Names, job_name: str) -> KubeObject:
    """`recipe` is the applied (resolved) recipe: its output_dir is on the claim."""
    from kubernetes.client import (
        V1Container,
        V1Job,
        V1JobSpec,
        V1ObjectMeta,
        V1PodSpec,
        V1PodTemplateSpec,
        V1ResourceRequirements,
        V1VolumeMount,
    )

    k8s = recipe.k8s
    worker = k8s.worker_resources()
    resources = {"cpu": str(worker["cpu"]), "memory": str(worker["memory"])}
    non_root = profiles.PROFILES[k8s.profile].non_root
    container = V1Container(
        name=CONTAINER,
        image=k8s.container_image(),
        image_pull_policy=k8s.image_pull_policy,
        command=export_command(recipe),
        env=objects.worker_env(recipe, names),
        resources=V1ResourceRequirements(requests=resources, limits=resources),
        volume_mounts=[V1VolumeMount(name="data", mount_path=DATA_DIR)],
        security_context=profiles.container_security(k8s) if non_root else None,
    )
    pod = V1PodSpec(
        containers=[container],
        volumes=[v for v in objects.worker_volumes(k8s, names) if v.name == "data"],
        restart_policy="Never",
        node_selector=dict(k8s.node_selector) or None,
        tolerations=profiles.tolerations(k8s),
        security_context=profiles.pod_security(k8s),
        service_account_name=k8s.service_account,
    )
    meta = objects.object_meta(names, job_name, CONTAINER)
    template = V1PodTemplateSpec(metadata=V1ObjectMeta(labels=meta.labels), spec=pod)
    job = V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=meta,
        spec=V1JobSpec(backoff_limit=BACKOFF_LIMIT, template=template),
    )
    return objects.to_dict(job)
