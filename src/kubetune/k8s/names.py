"""Names and fixed paths shared by render, submit, status, download, delete and doctor.

Every object of a job is named from the job name (`Names.for_job`), so the commands that
follow a job need only its name and namespace, not the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubetune.contracts.kube import COMPONENT, INSTANCE, KUBETUNE, common_labels

RECIPE_DIR = "/etc/kubetune"
RECIPE_KEY = "recipe.yaml"
RECIPE_PATH = f"{RECIPE_DIR}/{RECIPE_KEY}"
DATA_DIR = "/data"
TRAIN_COMMAND = ["kubetune", "train", RECIPE_PATH]
TOKEN_KEY = "HF_TOKEN"
CONTAINER = {"pytorchjob": "pytorch", "trainjob": "node"}  # names the operators look for
PYTORCHJOB_PORT = 23456  # the training operator's default `pytorchjob-port`
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"
COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"
VOLCANO_ANNOTATION = "scheduling.k8s.io/group-name"
DEFAULT_GANG_SCHEDULER = {"volcano": "volcano", "coscheduling": "scheduler-plugins-scheduler"}
DATA_POD_RESOURCES = {"cpu": "250m", "memory": "256Mi"}
# One per namespace (k8s.namespace_quota): every job there renders the same object.
NAMESPACE_QUOTA = "kubetune-namespace-quota"


@dataclass(frozen=True)
class Names:
    """Every object name derived from the job name, shared by render, submit and delete."""

    job: str
    namespace: str
    recipe: str
    secret: str
    pvc: str
    data_pod: str
    quota: str
    runtime: str
    claim_template: str  # the pods' ResourceClaimTemplate (k8s.devices=dra)
    owns_pvc: bool

    @classmethod
    def for_job(cls, job: str, namespace: str, existing_claim: str | None = None) -> Names:
        return cls(
            job=job,
            namespace=namespace,
            recipe=f"{job}-recipe",
            secret=f"{job}-hf-token",
            pvc=existing_claim or f"{job}-data",
            data_pod=f"{job}-data",
            quota=f"{job}-quota",
            runtime=f"{job}-runtime",
            claim_template=f"{job}-cards",
            owns_pvc=existing_claim is None,
        )


def standard_labels(names: Names, component: str) -> dict[str, str]:
    """Labels of every object of a job: `INSTANCE` = job name is what status, logs and delete select on."""
    return common_labels(KUBETUNE, component, instance=names.job, managed_by=KUBETUNE)


# The serving objects of a run (`k8s render-serve`) are an instance of their own, named
# `<job>-serve` by default, so that deleting the finished training job leaves serving up and
# the other way round. Their components: the pods and what routes to them, and autoscaling.
SERVE_SUFFIX = "-serve"
# GRPO's rollout server (finetune.rl.rollout=server) is the job's own: `<job>-rollout`, deleted with the job
ROLLOUT_SUFFIX = "-rollout"
SERVER_COMPONENT = "server"
AUTOSCALING_COMPONENT = "autoscaling"
SERVING_COMPONENTS = (SERVER_COMPONENT, AUTOSCALING_COMPONENT)


def server_selector(name: str) -> dict[str, str]:
    """The labels every serving pod of `name` carries (its Deployment's selector, the Service's)."""
    return {INSTANCE: name, COMPONENT: SERVER_COMPONENT}


def trainer_selector(job: str) -> dict[str, str]:
    """The labels every training pod of `job` carries (its pod template's `standard_labels`)."""
    return {INSTANCE: job, COMPONENT: "trainer"}
