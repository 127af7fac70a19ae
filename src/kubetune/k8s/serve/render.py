"""`render_serve`: the serving objects in apply order, and the warnings about them."""

from __future__ import annotations

from pathlib import Path

from kubetune.errors import RecipeError
from kubetune.k8s import claims, objects
from kubetune.k8s.names import DATA_DIR, SERVER_COMPONENT
from kubetune.k8s.render import Rendered, _refuse_token_leak
from kubetune.k8s.scrape import server_service_monitor
from kubetune.k8s.serve.autoscale import adapter_rule_config_map, autoscaler
from kubetune.k8s.serve.deployment import deployment, disruption_budget
from kubetune.k8s.serve.gateway import inference_objective, inference_pool
from kubetune.k8s.serve.network import ingress, network_policy, service
from kubetune.k8s.serve.plan import Plan, is_gguf, plan_for
from kubetune.k8s.serve.settings import ServeSettings
from kubetune.recipe.k8s import pod_resource_problems
from kubetune.recipe.schema import Recipe


def _warnings(plan: Plan) -> list[str]:
    k8s, settings = plan.k8s, plan.settings
    out = []
    if plan.engine == "native" and k8s.profile != "cpu":  # asked for: the default there is vLLM
        out.append(
            f"--engine native runs on CPUs and leaves this {k8s.profile} pod's accelerators idle; leave --engine out "
            "(vLLM serves with them, tensor parallel over all of them), or serve on CPUs with --profile cpu"
        )
    base = plan.recipe.model.name_or_path
    lora_base = plan.recipe.finetune.method == "lora" and not (plan.engine == "vllm" and is_gguf(base))
    if lora_base and base.startswith("/") and (settings.model_image or not base.startswith(DATA_DIR + "/")):
        out.append(
            f"model.name_or_path={base}: the serving pods load this base model but see only {plan.root}/; "
            f"use a hub id or a model directory on the claim ({DATA_DIR}/...)"
        )
    hi = settings.replica_range()[1]
    most = settings.replicas if settings.autoscale == "off" else hi
    if not settings.model_image and k8s.storage.access_mode == "ReadWriteOnce" and most > 1:
        out.append(
            f"claim {plan.job.pvc} is ReadWriteOnce: serving pods on another node cannot mount it; "
            "use a ReadWriteMany claim, --model-image, or one replica"
        )
    if settings.ingress_host is None:
        out.append(
            f"no --ingress-host: the Ingress answers on every host of class {settings.ingress_class} "
            "that no other rule claims"
        )
    return out + _access_warnings(settings) + claims.device_warnings(k8s)


def _access_warnings(settings: ServeSettings) -> list[str]:
    if not settings.api_key_secret:
        return ["no --api-key-secret: whoever reaches the Ingress or the Service can use the model"]
    if not (settings.ingress_tls_secret or settings.cert_manager_issuer):
        clear = "the API key crosses the network to the Ingress in clear text: add --ingress-tls-secret or "
        return [clear + "--cert-manager-issuer (with --ingress-host)"]
    return []


def served_models(plan: Plan) -> list[str]:
    """The model names requests use: the run's (its job's name: a LoRA run's adapter, or the full
    model) and each --adapter's."""
    return [plan.job.job] + [a.name for a in plan.settings.adapters]


def render_serve(
    recipe: Recipe, settings: ServeSettings, hf_token: str | None = None, local_run: Path | None = None
) -> Rendered:
    """The serving objects of the run `recipe` describes (k8s.profile already applied), in apply order."""
    problems = settings.problems() + pod_resource_problems(recipe.k8s)
    if problems:
        raise RecipeError(*problems)
    plan = plan_for(recipe, settings, local_run)
    out = [objects.namespace(plan.names)]
    if hf_token:  # the training job's Secret (the pods read that one): not a second copy of the token
        out.append(objects.secret(plan.job, hf_token))
    if settings.network_policy:  # before the Deployment: no pod ever runs unguarded
        out.append(network_policy(plan))
    if settings.autoscale == "queue":
        out.append(adapter_rule_config_map(plan))
    if recipe.k8s.devices == "dra":  # before the Deployment: its pods claim their cards from it
        out.append(claims.claim_template(recipe.k8s, plan.names, SERVER_COMPONENT))
    out += [deployment(plan), service(plan), disruption_budget(plan)]
    if recipe.monitor.in_cluster:
        out.append(server_service_monitor(plan.names, recipe.monitor.release, SERVER_COMPONENT))
    if settings.autoscale != "off":
        out.append(autoscaler(plan))
    out.append(ingress(plan))
    if settings.gateway:
        out += [inference_pool(plan)] + [inference_objective(plan, name) for name in served_models(plan)]
    if hf_token:
        _refuse_token_leak(out, hf_token)
    return Rendered(objects=out, names=plan.names, warnings=plan.warnings + _warnings(plan))
