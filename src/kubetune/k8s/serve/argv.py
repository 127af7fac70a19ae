"""The server's command and environment: `kubetune serve` (native) or vLLM's OpenAI server
(`vllm_run_options` from the pod's paths), its caches, threads, KV cache and API key."""

from __future__ import annotations

from decimal import ROUND_FLOOR
from pathlib import Path, PurePosixPath

from kubetune.contracts.kube import KubeObject, parse_quantity
from kubetune.contracts.serving import (
    DEFAULT_PORT,
    POD_HOST,
    Adapter,
    VllmOptions,
    VllmRun,
    vllm_argv,
    vllm_cpu_kvcache_gib,
    vllm_run_options,
)
from kubetune.errors import UserError
from kubetune.k8s.names import TOKEN_KEY
from kubetune.k8s.serve.plan import Plan, is_gguf
from kubetune.recipe.layout import model_shape
from kubetune.rundir import RunDir

CACHE_DIR = "/cache"  # vLLM's caches (compile, usage): an emptyDir, writable by the non-root user
# the Secret of --api-key-secret: its key `api-key` holds the server's key(s), comma-separated,
# read by the pods as kubetune serve's and vLLM's own variable (vLLM takes one key)
API_KEY_SECRET_KEY = "api-key"
API_KEY_ENV = {"native": "KUBETUNE_API_KEY", "vllm": "VLLM_API_KEY"}


def _pod_path(path: str, root: str) -> str:
    """An --adapter path as the pod sees it: absolute as given, relative under the volume's root."""
    p = PurePosixPath(path)
    return str(p if p.is_absolute() else PurePosixPath(root) / p)


def _adapters_in_pod(plan: Plan) -> tuple[Adapter, ...]:
    return tuple(Adapter(a.name, _pod_path(a.path, plan.root)) for a in plan.settings.adapters)


def native_argv(plan: Plan) -> list[str]:
    served = plan.recipe.model.name_or_path if plan.rollout else plan.run_dir
    argv = ["kubetune", "serve", served, "--host", POD_HOST, "--port", str(DEFAULT_PORT), "--engine", "native"]
    if plan.rollout:  # the trainer loads each version of its adapter, and unloads the last
        argv.append("--allow-runtime-adapters")
    for a in _adapters_in_pod(plan):
        argv += ["--adapter", f"{a.name}={a.path}"]
    shared = plan.adapter_serving
    if shared is not None:  # a ModelServer: adapters arrive at run time and from the registry at start
        argv += ["--allow-runtime-adapters", "--adapter-registry", shared.registry, "--adapter-root", shared.root]
    max_loras = shared.max_loras if shared is not None else plan.settings.max_loras
    if max_loras:
        argv += ["--max-loras", str(max_loras)]
    return argv


def _tensor_parallel(plan: Plan) -> int:
    accelerators = int(plan.k8s.worker_resources()["accelerators"]) if plan.k8s.profile != "cpu" else 0
    tp = max(1, accelerators)
    shape = model_shape(plan.recipe.model.name_or_path)
    if tp > 1 and shape is not None and shape.num_attention_heads % tp:
        raise UserError(
            f"vLLM shards the model over the pod's {tp} accelerators (tensor parallel), but "
            f"{plan.recipe.model.name_or_path} has {shape.num_attention_heads} attention heads: set "
            f"k8s.resources.accelerators to a divisor of {shape.num_attention_heads}"
        )
    return tp


def vllm_options(plan: Plan) -> VllmOptions:
    """What vLLM serves (`vllm_run_options`) from the pod's paths; over the embedded GGUF default,
    which vLLM cannot load, the run's merged export. The pod cannot read the other adapters'
    recipes: the run's own rank sizes --max-lora-rank."""
    recipe, run = plan.recipe, RunDir(Path(plan.run_dir))
    extra = tuple(Adapter(a.name, RunDir(Path(a.path)).weights("lora").as_posix()) for a in _adapters_in_pod(plan))
    base = recipe.model.name_or_path
    tp = _tensor_parallel(plan)
    if recipe.finetune.method == "lora" and is_gguf(base):
        if extra:
            raise UserError(
                f"--adapter with --engine vllm needs a base model vLLM loads, and {base} is a GGUF file; "
                "serve these adapters with --engine native"
            )
        plan.warnings.append(
            f"vLLM cannot load the GGUF base {base}: it serves the merged model {run.merged.as_posix()}, "
            f"which `kubetune export {plan.run_dir} --merged` writes (run it before the pods start)"
        )
        return VllmOptions(
            model=run.merged.as_posix(),
            served_name=plan.job.job,
            host=POD_HOST,
            port=DEFAULT_PORT,
            tensor_parallel_size=tp,
            trust_remote_code=recipe.model.trust_remote_code,
        )
    served_base = PurePosixPath(base).name if base.startswith("/") else base
    method = recipe.finetune.method
    lora_rank = recipe.lora.r if method == "lora" else None
    vllm_run = VllmRun(
        run.weights(method).as_posix(),
        lora_rank,
        plan.job.job,
        base,
        served_base,
        extra,
        revision=recipe.model.revision,
        trust_remote_code=recipe.model.trust_remote_code,
    )
    return vllm_run_options(vllm_run, POD_HOST, DEFAULT_PORT, tensor_parallel_size=tp)


def server_argv(plan: Plan) -> list[str]:
    if plan.engine == "native":
        return native_argv(plan)
    argv = vllm_argv(vllm_options(plan))
    argv[0] = "python3"  # vLLM's images have python3; not every one has `python`
    if plan.settings.max_loras and "--max-loras" in argv:  # vLLM's default: every declared adapter
        argv[argv.index("--max-loras") + 1] = str(plan.settings.max_loras)
    return argv


def _cpu_threads(plan: Plan) -> int:
    cpu = parse_quantity(plan.k8s.worker_resources()["cpu"])
    return max(1, int(cpu.to_integral_value(ROUND_FLOOR)))


def _memory_bytes(plan: Plan) -> int:
    return int(parse_quantity(plan.k8s.worker_resources()["memory"]))


def server_env(plan: Plan) -> list[KubeObject]:
    caches = CACHE_DIR if plan.rollout else plan.root  # a rollout server's claim is read-only
    env: list[KubeObject] = [
        {"name": "HF_HOME", "value": f"{caches}/hf"},
        # The training job's token Secret, one per job. Optional even for a gated model: the job
        # left the base model in HF_HOME on the claim, where the Hub's client falls back to it,
        # and a pod must still start after `kubetune k8s delete JOB` has removed that Secret.
        {
            "name": TOKEN_KEY,
            "valueFrom": {"secretKeyRef": {"name": plan.job.secret, "key": TOKEN_KEY, "optional": True}},
        },
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if plan.engine == "native":
        env.insert(0, {"name": "KUBETUNE_CACHE", "value": f"{caches}/cache"})
    else:
        env += [
            {"name": "VLLM_CACHE_ROOT", "value": f"{CACHE_DIR}/vllm"},
            {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
            {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
        ]
    if plan.k8s.profile == "cpu":
        env.append({"name": "OMP_NUM_THREADS", "value": str(_cpu_threads(plan))})
        if plan.engine == "vllm":
            env.append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": str(_kvcache_gib(plan))})
    if plan.k8s.profile == "gaudi" and plan.engine == "vllm":
        # tensor parallel with HPU graphs needs the lazy collectives (Intel's vLLM docs)
        env.append({"name": "PT_HPU_ENABLE_LAZY_COLLECTIVES", "value": "true"})
    if plan.settings.api_key_secret:
        env.append(_api_key_env(plan))
    return env


def _api_key_env(plan: Plan) -> KubeObject:
    """The server's key(s) from --api-key-secret. Not optional: without that Secret the pod does
    not start (CreateContainerConfigError) rather than serve an open API."""
    ref = {"name": plan.settings.api_key_secret, "key": API_KEY_SECRET_KEY}
    return {"name": API_KEY_ENV[plan.engine], "valueFrom": {"secretKeyRef": ref}}


def _kvcache_gib(plan: Plan) -> int:
    memory = _memory_bytes(plan)
    if plan.params is None:
        plan.warnings.append(
            f"the size of {plan.recipe.model.name_or_path} is unknown: VLLM_CPU_KVCACHE_SPACE assumes its "
            "weights take half the memory limit"
        )
        weights = memory // 2
    else:
        weights = plan.params * 2  # bf16
    return vllm_cpu_kvcache_gib(memory, weights)
