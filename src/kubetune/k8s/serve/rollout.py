"""GRPO's rollout server on the cluster (finetune.rl.rollout = server): a Deployment of
`kubetune serve <base model> --allow-runtime-adapters` and its Service, beside the training job.

The trainer writes each version of its adapter under its output_dir on the job's claim and
asks the server to load it from there; so the server's pod mounts the same claim at the same
path (/data), read-only, and keeps its caches (a hub base model's download) in an emptyDir of
its own. The trainer and the server share the claim: ReadWriteMany, or both pods on one node.

`kubetune k8s render` adds these objects when the recipe leaves finetune.rl.server_url unset
(it is set to the Service's address in the job's recipe) or names this Service already; a URL
elsewhere is a server the user runs, and nothing is added. The Deployment and Service come from
render-serve's own builders (`deployment`, `service`), in the native engine.
"""

from __future__ import annotations

from kubetune.contracts.kube import KubeObject
from kubetune.contracts.serving import DEFAULT_PORT
from kubetune.k8s import profiles
from kubetune.k8s.names import ROLLOUT_SUFFIX
from kubetune.k8s.render import job_name
from kubetune.k8s.serve.deployment import deployment
from kubetune.k8s.serve.network import network_policy, service
from kubetune.k8s.serve.plan import plan_for
from kubetune.k8s.serve.settings import ServeSettings
from kubetune.recipe.schema import Recipe


def rollout_name(recipe: Recipe) -> str:
    return f"{job_name(recipe)}{ROLLOUT_SUFFIX}"


def service_url(recipe: Recipe) -> str:
    """The rollout Service's address as the job's pods reach it."""
    return f"http://{rollout_name(recipe)}.{recipe.k8s.namespace}.svc:{DEFAULT_PORT}"


def renders_server(recipe: Recipe) -> bool:
    """rollout=server with no server_url, or with this job's own rollout Service's."""
    rl = recipe.finetune.rl
    grpo_from_server = recipe.finetune.objective == "grpo" and rl.rollout == "server"
    return grpo_from_server and rl.server_url in (None, service_url(recipe))


def with_server_url(recipe: Recipe) -> Recipe:
    """The recipe with finetune.rl.server_url set to the rollout Service's address."""
    rl = recipe.finetune.rl.model_copy(update={"server_url": service_url(recipe)})
    finetune = recipe.finetune.model_copy(update={"rl": rl})
    return recipe.model_copy(update={"finetune": finetune})


def rollout_objects(recipe: Recipe) -> tuple[list[KubeObject], list[str]]:
    """(NetworkPolicy, Deployment, Service of the rollout server; the warnings about them)."""
    settings = ServeSettings(engine="native", name=rollout_name(recipe), replicas=1, autoscale="off")
    plan = plan_for(recipe, settings, None)
    plan.rollout = True
    objects = [network_policy(plan), on_cpus(deployment(plan), recipe), service(plan)]
    return objects, plan.warnings + _warnings(recipe)


def on_cpus(server: KubeObject, recipe: Recipe) -> KubeObject:
    """The Deployment without the training pod's accelerators: the native engine samples on CPUs,
    and cards held idle by the server would be cards the trainer cannot have."""
    pod = server["spec"]["template"]["spec"]
    pod.pop("resourceClaims", None)  # k8s.devices=dra: the cards' claim
    resources = pod["containers"][0]["resources"]
    resources.pop("claims", None)
    card = profiles.PROFILES[recipe.k8s.profile].accelerator_resource
    for part in ("limits", "requests"):
        resources[part].pop(card, None)
    return server


def _warnings(recipe: Recipe) -> list[str]:
    k8s, out = recipe.k8s, []
    if k8s.storage.access_mode == "ReadWriteOnce":
        out.append(
            f"k8s.storage.access_mode=ReadWriteOnce: the rollout server ({rollout_name(recipe)}) reads the adapters "
            "the trainer writes on the job's claim, so its pod must run on the trainer's node; use ReadWriteMany "
            "where they may be apart"
        )
    if k8s.profile != "cpu":
        out.append(
            f"the rollout server runs kubetune serve's native engine on CPUs (the CPU and memory of a {k8s.profile} "
            "training pod, no accelerators); finetune.rl.rollout=local samples on the trainer's accelerators instead"
        )
    return out
