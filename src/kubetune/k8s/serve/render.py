"""Render (pure): a trained run -> the Kubernetes objects that serve it (`kubetune k8s render-serve`).

Objects, in apply order, all in the recipe's `k8s.namespace` (the training job's, so that its
volume claim can be mounted), named `<job>-serve` unless `--name` says otherwise:

- Namespace, [Secret] (the Hugging Face token, for gated base models),
- [NetworkPolicy] (default on): the server's port open to the namespace's own pods, the ingress
  controller's namespace and the monitoring namespace only,
- [ConfigMap `<name>-prometheus-adapter-rule`] (with `--autoscale queue`): the prometheus-adapter
  rule that exposes `vllm:num_requests_waiting` to the HorizontalPodAutoscaler, renamed
  `vllm_num_requests_waiting` (a Kubernetes metric name cannot hold ':'), as the adapter's
  config file (`rules.yaml`) and as values of its Helm chart (`helm-values.yaml`),
- Deployment: `kubetune serve RUN_DIR --engine native` or vLLM's OpenAI server (`--engine
  vllm`, vLLM's image for the profile); the run directory read from the training job's
  claim at `/data` (where the job wrote `output_dir`), or copied out of `--model-image` by an
  init container; probes from `kubetune.serve.contract`, a startup probe sized to the model,
  Guaranteed QoS from the profile, a grace period that covers the server's drain,
- Service (port 8000, `http`), PodDisruptionBudget (maxUnavailable 1),
- [ServiceMonitor, with monitor.in_cluster]: Prometheus scrapes the Service's `http` port
  (`kubetune.k8s.scrape`, labelled with monitor.release),
- [HorizontalPodAutoscaler autoscaling/v2] on the waiting requests per pod, CPU as fallback,
- Ingress (nginx: no buffering of server-sent events, long timeouts, the server's body limit;
  TLS from a Secret or a cert-manager issuer).

The API key is never rendered: `--api-key-secret` names a Secret the pods read it from.

Plain dicts except where `profiles` already builds a part. No torch, no API calls.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import ROUND_FLOOR
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from kubetune.errors import RecipeError, UserError
from kubetune.k8s import objects, profiles
from kubetune.k8s.names import (
    AUTOSCALING_COMPONENT,
    DATA_DIR,
    SERVE_SUFFIX,
    SERVER_COMPONENT,
    TOKEN_KEY,
    Names,
    server_selector,
    standard_labels,
)
from kubetune.k8s.render import Rendered, _refuse_token_leak, cluster_recipe, job_name
from kubetune.k8s.scrape import server_service_monitor
from kubetune.kube import KubeObject, parse_quantity
from kubetune.recipe.k8s import VLLM_IMAGES, K8sSection, pod_resource_problems
from kubetune.recipe.layout import model_shape
from kubetune.recipe.loader import load_recipe
from kubetune.recipe.schema import DEFAULT_MODEL, Recipe
from kubetune.rundir import RunDir
from kubetune.serve.contract import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_PORT,
    DRAIN_TIMEOUT_S,
    HEALTH_PATH,
    METRICS_PATH,
    READY_PATH,
    VLLM_READY_PATH,
    WAITING_METRIC,
    Adapter,
    VllmOptions,
    VllmRun,
    vllm_argv,
    vllm_cpu_kvcache_gib,
    vllm_run_options,
)

ENGINES = ("native", "vllm")  # `auto` picks by what is installed, which a manifest cannot know
AUTOSCALE = ("queue", "cpu", "off")
CONTAINER = "server"
PORT_NAME = "http"
# The custom metric the HPA asks for: WAITING_METRIC as prometheus-adapter renames it.
QUEUE_METRIC = WAITING_METRIC.replace(":", "_")
# --model-image: the image holds the run directory here; an init container copies it into an
# emptyDir at MODELS_DIR, where the server reads it (and caches what it downloads).
MODEL_IMAGE_DIR = "/model"
MODELS_DIR = "/models"
CACHE_DIR = "/cache"  # vLLM's caches (compile, usage): an emptyDir, writable by the non-root user

# Start-up budget: the startup probe allows this long before liveness takes over (a pod killed
# while its model loads starts the load over). bf16 weights read from a network volume at
# ~35 MB/s under load, plus the process start and a first warm-up; vLLM on Gaudi also compiles
# an HPU graph per bucket before it serves.
LOAD_BASE_S = 300
LOAD_S_PER_GIB = 30
UNKNOWN_LOAD_S = 1800
GAUDI_VLLM_WARMUP_S = 1200
PROBE_PERIOD_S = 10
# preStop: the pod leaves the Service's endpoints while this sleeps, so the ingress controller
# stops sending it requests before SIGTERM makes the server refuse them.
PRESTOP_SLEEP_S = 10
EXIT_MARGIN_S = 10
INGRESS_TIMEOUT_S = 3600  # a long answer streams for minutes; nginx's default cuts it at 60 s
# the Secret of --api-key-secret: its key `api-key` holds the server's key(s), comma-separated,
# read by the pods as kubetune serve's and vLLM's own variable (vLLM takes one key)
API_KEY_SECRET_KEY = "api-key"
API_KEY_ENV = {"native": "KUBETUNE_API_KEY", "vllm": "VLLM_API_KEY"}
CPU_FEATURE_WEIGHT = 100  # the preferred node affinity's weight (1..100): the strongest preference

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_SIZE = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)([bm])(?![a-z0-9])")


@dataclass(frozen=True)
class ServeSettings:
    """The command line of `render-serve` (and `submit --serve`), defaults applied."""

    engine: str = "native"
    replicas: int = 1
    min_replicas: int | None = None  # HPA minReplicas; None = replicas
    max_replicas: int | None = None  # HPA maxReplicas; None = max(4, min)
    adapters: tuple[Adapter, ...] = ()
    image: str | None = None  # the server's image; None = kubetune's (native) or vLLM's (vllm) for the profile
    model_image: str | None = None  # read the run from this image instead of the job's claim
    name: str | None = None
    ingress_host: str | None = None
    ingress_class: str = "nginx"
    autoscale: str = "queue"
    queue_target: int = 2  # waiting requests per pod the HPA aims at
    cpu_target: int = 80  # CPU utilisation (% of the request) the HPA aims at
    api_key_secret: str | None = None  # an existing Secret whose key `api-key` the server requires; None = open
    network_policy: bool = True  # the NetworkPolicy `<name>`; off where the cluster's policies are managed elsewhere
    ingress_namespace: str = "ingress-nginx"  # the ingress controller's namespace (allowed by the NetworkPolicy)
    monitoring_namespace: str = "monitoring"  # Prometheus's namespace (allowed, for /metrics)
    ingress_tls_secret: str | None = None  # TLS on the Ingress from this kubernetes.io/tls Secret
    cert_manager_issuer: str | None = None  # TLS from cert-manager: this ClusterIssuer writes the Secret
    require_cpu_features: bool = False  # cpu: only nodes with k8s.amx_label (else they are preferred)

    def replica_range(self) -> tuple[int, int]:
        lo = self.min_replicas if self.min_replicas is not None else self.replicas
        hi = self.max_replicas if self.max_replicas is not None else max(4, lo)
        return lo, hi

    def problems(self) -> list[str]:
        out = []
        if self.engine not in ENGINES:
            out.append(
                f"--engine {self.engine}: use native or vllm (auto picks by what is installed, "
                "which a manifest cannot know)"
            )
        if self.autoscale not in AUTOSCALE:
            out.append(f"--autoscale {self.autoscale}: use queue, cpu or off")
        lo, hi = self.replica_range()
        if self.replicas < 1 or lo < 1:
            out.append(f"--replicas/--min-replicas must be at least 1 (got {min(self.replicas, lo)})")
        elif hi < lo:
            out.append(f"--max-replicas {hi} is below --min-replicas {lo}")
        if self.queue_target < 1:
            out.append(f"--queue-target {self.queue_target}: waiting requests per pod must be at least 1")
        if not 1 <= self.cpu_target <= 100:
            out.append(f"--cpu-target {self.cpu_target}: a utilisation in percent, 1..100")
        names = [a.name for a in self.adapters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            out.append(f"--adapter names must be unique (repeated: {', '.join(dupes)})")
        if self.name is not None and (len(self.name) > 63 or not _DNS_1035.match(self.name)):
            out.append(
                f"--name {self.name!r}: a Service name is a DNS-1035 label (a lower-case letter first, "
                "then letters, digits or '-', at most 63)"
            )
        if self.ingress_host is not None and not re.fullmatch(r"[a-z0-9*]([-a-z0-9.]*[a-z0-9])?", self.ingress_host):
            out.append(f"--ingress-host {self.ingress_host!r}: a DNS name such as llm.example.com")
        return out + self.access_problems()

    def access_problems(self) -> list[str]:
        """The API key's Secret, the NetworkPolicy's namespaces, the Ingress's TLS."""
        out = []
        for flag, value, pattern, what in (
            ("--api-key-secret", self.api_key_secret, _DNS_1123_SUBDOMAIN, "a Secret name"),
            ("--ingress-tls-secret", self.ingress_tls_secret, _DNS_1123_SUBDOMAIN, "a Secret name"),
            ("--cert-manager-issuer", self.cert_manager_issuer, _DNS_1123_SUBDOMAIN, "a ClusterIssuer name"),
            ("--ingress-namespace", self.ingress_namespace, _DNS_1123_LABEL, "a namespace"),
            ("--monitoring-namespace", self.monitoring_namespace, _DNS_1123_LABEL, "a namespace"),
        ):
            if value is not None and (
                len(value) > (63 if pattern is _DNS_1123_LABEL else 253) or not pattern.match(value)
            ):
                out.append(f"{flag} {value!r}: {what} is lower-case letters, digits and '-' (e.g. llm-serve)")
        if (self.ingress_tls_secret or self.cert_manager_issuer) and not self.ingress_host:
            out.append(
                "--ingress-tls-secret/--cert-manager-issuer: a certificate is for a host; give --ingress-host too"
            )
        return out


# ---------------------------------------------------------------------------------- the source


def load_source(source: str, overrides: list[str]) -> tuple[Recipe, Path | None]:
    """RUN|RECIPE -> (recipe, the local run directory or None). A directory is a run that
    `kubetune train` wrote (its recipe.yaml, read without torch); anything else a recipe
    (file or builtin name), whose run is where its training job writes `output_dir`."""
    path = Path(source).expanduser()
    if path.is_dir():
        run = RunDir(path)
        recipe = run.recipe(overrides)
        run.finished_weights(recipe)
        return recipe, path
    return load_recipe(source, overrides).recipe, None


def model_params(name_or_path: str) -> int | None:
    """Parameters read from the model's name (`Llama-2-7b-chat-hf` 7e9, `smollm2-135m-instruct`
    135e6), None when its name does not say."""
    name = PurePosixPath(name_or_path.rstrip("/")).name.lower().replace("_", "-")
    found = _SIZE.findall(name)
    if not found:
        return None
    number, unit = found[-1]
    return int(float(number) * (1e9 if unit == "b" else 1e6))


def startup_seconds(params: int | None, engine: str, profile: str) -> int:
    """How long a pod may take to load the model before liveness checks begin."""
    if params is None:
        seconds = UNKNOWN_LOAD_S
    else:
        seconds = LOAD_BASE_S + math.ceil(params * 2 / 2**30 * LOAD_S_PER_GIB)
    if engine == "vllm" and profile == "gaudi":
        seconds += GAUDI_VLLM_WARMUP_S
    return seconds


def is_gguf(name_or_path: str) -> bool:
    return name_or_path == DEFAULT_MODEL or name_or_path.lower().endswith(".gguf")


# ---------------------------------------------------------------------------------- the plan


@dataclass
class _Plan:
    """What the objects share, worked out once."""

    recipe: Recipe
    settings: ServeSettings
    names: Names  # the serving instance (its name, its token Secret)
    job: Names  # the training job (its claim)
    run_dir: str  # the run directory as the server sees it
    root: str  # where relative --adapter paths and caches live: /data (claim) or /models (image)
    params: int | None
    warnings: list[str] = field(default_factory=list)

    @property
    def k8s(self) -> K8sSection:
        return self.recipe.k8s

    @property
    def engine(self) -> str:
        return self.settings.engine

    @property
    def labels(self) -> dict[str, str]:
        return standard_labels(self.names, SERVER_COMPONENT)

    @property
    def selector(self) -> dict[str, str]:
        return server_selector(self.names.job)

    def meta(self, name: str, component: str = SERVER_COMPONENT, **extra: Any) -> KubeObject:
        meta: KubeObject = {
            "name": name,
            "namespace": self.names.namespace,
            "labels": standard_labels(self.names, component),
        }
        return {**meta, **extra}


def _pod_path(path: str, root: str) -> str:
    """An --adapter path as the pod sees it: absolute as given, relative under the volume's root."""
    p = PurePosixPath(path)
    return str(p if p.is_absolute() else PurePosixPath(root) / p)


def _plan(recipe: Recipe, settings: ServeSettings, local_run: Path | None) -> _Plan:
    k8s = recipe.k8s
    job = Names.for_job(job_name(recipe), k8s.namespace, k8s.storage.existing_claim)
    name = settings.name or f"{job.job}{SERVE_SUFFIX}"
    if len(name) > 63 or not _DNS_1035.match(name):
        raise UserError(
            f"the serving name {name!r} is not a DNS-1035 label (a lower-case letter first, at most 63): "
            "give one with --name"
        )
    names = Names.for_job(name, k8s.namespace)
    if settings.model_image:
        root = MODELS_DIR
        run_dir = f"{MODELS_DIR}/{job.job}"
    else:
        root = DATA_DIR
        run_dir = cluster_recipe(recipe, job).output_dir
    plan = _Plan(recipe, settings, names, job, run_dir, root, model_params(recipe.model.name_or_path))
    if local_run is not None:
        where = (
            f"the image {settings.model_image} at {MODEL_IMAGE_DIR}"
            if settings.model_image
            else f"claim {job.pvc} at {run_dir} (`kubectl cp {local_run} {k8s.namespace}/{job.data_pod}:{run_dir}`)"
        )
        plan.warnings.append(f"{local_run} is a local run: the pods read it from {where}; put it there first")
    return plan


# ---------------------------------------------------------------------------------- the server


def _adapters_in_pod(plan: _Plan) -> tuple[Adapter, ...]:
    return tuple(Adapter(a.name, _pod_path(a.path, plan.root)) for a in plan.settings.adapters)


def native_argv(plan: _Plan) -> list[str]:
    argv = ["kubetune", "serve", plan.run_dir, "--host", "0.0.0.0", "--port", str(DEFAULT_PORT), "--engine", "native"]
    for a in _adapters_in_pod(plan):
        argv += ["--adapter", f"{a.name}={a.path}"]
    return argv


def _tensor_parallel(plan: _Plan) -> int:
    accelerators = int(plan.k8s.worker_resources()["accelerators"]) if plan.k8s.profile != "cpu" else 0
    tp = max(1, accelerators)
    shape = model_shape(plan.recipe.model.name_or_path)
    if tp > 1 and shape is not None and shape.num_attention_heads % tp:
        raise UserError(
            f"--engine vllm shards the model over the pod's {tp} accelerators (tensor parallel), but "
            f"{plan.recipe.model.name_or_path} has {shape.num_attention_heads} attention heads: set "
            f"k8s.resources.accelerators to a divisor of {shape.num_attention_heads}"
        )
    return tp


def vllm_options(plan: _Plan) -> VllmOptions:
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
            host="0.0.0.0",
            port=DEFAULT_PORT,
            tensor_parallel_size=tp,
        )
    served_base = PurePosixPath(base).name if base.startswith("/") else base
    vllm_run = VllmRun(recipe, plan.run_dir, plan.job.job, base, served_base, extra)
    return vllm_run_options(vllm_run, "0.0.0.0", DEFAULT_PORT, tensor_parallel_size=tp)


def server_argv(plan: _Plan) -> list[str]:
    if plan.engine == "native":
        return native_argv(plan)
    argv = vllm_argv(vllm_options(plan))
    argv[0] = "python3"  # vLLM's images have python3; not every one has `python`
    return argv


def _cpu_threads(plan: _Plan) -> int:
    cpu = parse_quantity(plan.k8s.worker_resources()["cpu"])
    return max(1, int(cpu.to_integral_value(ROUND_FLOOR)))


def _memory_bytes(plan: _Plan) -> int:
    return int(parse_quantity(plan.k8s.worker_resources()["memory"]))


def server_env(plan: _Plan) -> list[KubeObject]:
    env: list[KubeObject] = [
        {"name": "HF_HOME", "value": f"{plan.root}/hf"},
        {
            "name": TOKEN_KEY,
            "valueFrom": {"secretKeyRef": {"name": plan.names.secret, "key": TOKEN_KEY, "optional": True}},
        },
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if plan.engine == "native":
        env.insert(0, {"name": "KUBETUNE_CACHE", "value": f"{plan.root}/cache"})
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


def _api_key_env(plan: _Plan) -> KubeObject:
    """The server's key(s) from --api-key-secret. Not optional: without that Secret the pod does
    not start (CreateContainerConfigError) rather than serve an open API."""
    ref = {"name": plan.settings.api_key_secret, "key": API_KEY_SECRET_KEY}
    return {"name": API_KEY_ENV[plan.engine], "valueFrom": {"secretKeyRef": ref}}


def _kvcache_gib(plan: _Plan) -> int:
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


def _probe(path: str, period: int, timeout: int, failures: int) -> KubeObject:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _ready_path(plan: _Plan) -> str:
    if plan.engine == "native":
        return READY_PATH
    # vLLM asks for the key on /v1/models, and a probe could only send it written into the manifest;
    # its /health stays open and, as vLLM listens only once the model is loaded, means ready too.
    return HEALTH_PATH if plan.settings.api_key_secret else VLLM_READY_PATH


def server_container(plan: _Plan, startup_s: int) -> KubeObject:
    ready = _ready_path(plan)
    mounts: list[KubeObject] = [
        {"name": "models" if plan.settings.model_image else "data", "mountPath": plan.root},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if plan.engine == "vllm":
        mounts.append({"name": "cache", "mountPath": CACHE_DIR})
    container: KubeObject = {
        "name": CONTAINER,
        "image": plan.settings.image
        or (plan.k8s.container_image() if plan.engine == "native" else VLLM_IMAGES[plan.k8s.profile]),
        "imagePullPolicy": plan.k8s.image_pull_policy,
        "command": server_argv(plan),
        "env": server_env(plan),
        "ports": [{"name": PORT_NAME, "containerPort": DEFAULT_PORT, "protocol": "TCP"}],
        "resources": objects.to_dict(profiles.worker_resources(plan.k8s)),
        "volumeMounts": mounts,
        # Liveness only starts once the model is loaded (startup passed): a busy CPU pod that
        # answers /health slowly gets a minute before it is restarted.
        "startupProbe": _probe(ready, PROBE_PERIOD_S, 5, math.ceil(startup_s / PROBE_PERIOD_S)),
        "readinessProbe": _probe(ready, 5, 5, 3),
        "livenessProbe": _probe(HEALTH_PATH, 10, 10, 6),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}},
        "securityContext": objects.to_dict(profiles.container_security(plan.k8s)),
    }
    return container


def _model_copier(plan: _Plan, container: KubeObject) -> KubeObject:
    """--model-image: copy the run directory out of the image before the server starts."""
    limits = {k: v for k, v in container["resources"]["limits"].items() if k in ("cpu", "memory")}
    return {
        "name": "model",
        "image": plan.settings.model_image,
        "imagePullPolicy": plan.k8s.image_pull_policy,
        "command": ["cp", "-R", f"{MODEL_IMAGE_DIR}/.", plan.run_dir],
        # as much as the server asks for (and no more), so the pod stays Guaranteed
        "resources": {"requests": dict(limits), "limits": limits},
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR}],
        "securityContext": container["securityContext"],
    }


def _volumes(plan: _Plan) -> list[KubeObject]:
    shm = plan.k8s.worker_resources()["shm_size"]
    dshm: KubeObject = {"medium": "Memory"}
    if shm:
        dshm["sizeLimit"] = str(shm)
    volumes: list[KubeObject] = [
        {"name": "models", "emptyDir": {}}
        if plan.settings.model_image
        else {"name": "data", "persistentVolumeClaim": {"claimName": plan.job.pvc}},
        {"name": "dshm", "emptyDir": dshm},
    ]
    if plan.engine == "vllm":
        volumes.append({"name": "cache", "emptyDir": {}})
    return volumes


def _affinity(plan: _Plan) -> KubeObject | None:
    """The profile's CPU-feature requirement (cpu: AMX nodes, for bf16 matmuls) as a preference
    unless --require-cpu-features: on a cluster without such nodes (or without their NFD label) the
    server is scheduled anyway and runs in fp32, where a requirement would leave it Pending."""
    affinity: KubeObject | None = objects.to_dict(profiles.node_affinity(plan.k8s))
    if not affinity or plan.settings.require_cpu_features:
        return affinity
    node = affinity["nodeAffinity"]
    terms = node.pop("requiredDuringSchedulingIgnoredDuringExecution")["nodeSelectorTerms"]
    node["preferredDuringSchedulingIgnoredDuringExecution"] = [
        {"weight": CPU_FEATURE_WEIGHT, "preference": term} for term in terms
    ]
    return affinity


def _drop_none(d: KubeObject) -> KubeObject:
    return {k: v for k, v in d.items() if v is not None}


def deployment(plan: _Plan) -> KubeObject:
    k8s, settings = plan.k8s, plan.settings
    startup_s = startup_seconds(plan.params, plan.engine, k8s.profile)
    container = server_container(plan, startup_s)
    pod_spec: KubeObject = _drop_none(
        {
            "initContainers": [_model_copier(plan, container)] if settings.model_image else None,
            "containers": [container],
            "volumes": _volumes(plan),
            "terminationGracePeriodSeconds": PRESTOP_SLEEP_S + DRAIN_TIMEOUT_S + EXIT_MARGIN_S,
            "automountServiceAccountToken": False,  # the server never talks to the API server
            "nodeSelector": dict(k8s.node_selector) or None,
            "tolerations": objects.to_dict(profiles.tolerations(k8s)),
            "affinity": _affinity(plan),
            "securityContext": objects.to_dict(profiles.pod_security(k8s)),
            "hostIPC": True if profiles.PROFILES[k8s.profile].host_ipc else None,
            "priorityClassName": k8s.priority_class,
            "serviceAccountName": k8s.service_account,
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": plan.selector},
                }
            ],
        }
    )
    template = {
        "metadata": {
            "labels": plan.labels,
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(DEFAULT_PORT),
                "prometheus.io/path": METRICS_PATH,
            },
        },
        "spec": pod_spec,
    }
    spec: KubeObject = {
        "selector": {"matchLabels": plan.selector},
        # a new pod loads its model before an old one leaves
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        # loading is progress: the rollout is not "failed" while the startup probe still waits
        "progressDeadlineSeconds": startup_s + 300,
        "revisionHistoryLimit": 3,
        "template": template,
    }
    if settings.autoscale == "off":
        spec = {"replicas": settings.replicas, **spec}
    # else no replicas: the HPA owns the count, and re-applying this object must not reset it
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": plan.meta(plan.names.job), "spec": spec}


def service(plan: _Plan) -> KubeObject:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": plan.meta(plan.names.job),
        "spec": {
            "type": "ClusterIP",
            "selector": plan.selector,
            "ports": [{"name": PORT_NAME, "port": DEFAULT_PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def network_policy(plan: _Plan) -> KubeObject:
    """Who may open the server's port: the namespace's own pods, the ingress controller and
    Prometheus; nobody else. A NetworkPolicy sees ports, not paths, so Prometheus reaches the API
    as well as /metrics (the API key guards the API). The kubelet's probes come from the node, not
    from a pod, and pass. Egress stays open: a hub base model is downloaded at start (HF_HOME)
    and the names it needs resolved, where a run on the claim or in an image needs nothing."""
    settings = plan.settings

    def namespace(name: str) -> KubeObject:
        return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}}}

    peers = [{"podSelector": {}}, namespace(settings.ingress_namespace), namespace(settings.monitoring_namespace)]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": plan.meta(plan.names.job),
        "spec": {
            "podSelector": {"matchLabels": plan.selector},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"port": PORT_NAME, "protocol": "TCP"}]}],
        },
    }


def nginx_size(n_bytes: int) -> str:
    """A byte count in nginx's size syntax (k and m are binary), exactly."""
    for unit, scale in (("m", 1 << 20), ("k", 1 << 10)):
        if n_bytes % scale == 0:
            return f"{n_bytes // scale}{unit}"
    return str(n_bytes)


def _ingress_annotations(plan: _Plan) -> dict[str, str]:
    nginx = "nginx.ingress.kubernetes.io"
    annotations = {
        # server-sent events: each token goes out as it is made, not when nginx's buffer fills
        f"{nginx}/proxy-buffering": "off",
        f"{nginx}/proxy-request-buffering": "off",
        f"{nginx}/proxy-read-timeout": str(INGRESS_TIMEOUT_S),
        f"{nginx}/proxy-send-timeout": str(INGRESS_TIMEOUT_S),
        # what the server accepts (--max-body-bytes): a larger body stops at the edge of the cluster
        f"{nginx}/proxy-body-size": nginx_size(DEFAULT_MAX_BODY_BYTES),
    }
    if plan.settings.cert_manager_issuer:
        annotations["cert-manager.io/cluster-issuer"] = plan.settings.cert_manager_issuer
    return annotations


def _ingress_tls(plan: _Plan) -> list[KubeObject] | None:
    """TLS for --ingress-host from --ingress-tls-secret, or from the Secret cert-manager writes."""
    settings = plan.settings
    secret = settings.ingress_tls_secret or (f"{plan.names.job}-tls" if settings.cert_manager_issuer else None)
    if secret is None:
        return None
    return [{"hosts": [settings.ingress_host], "secretName": secret}]


def ingress(plan: _Plan) -> KubeObject:
    backend = {"service": {"name": plan.names.job, "port": {"name": PORT_NAME}}}
    rule: KubeObject = {"http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": backend}]}}
    if plan.settings.ingress_host:
        rule = {"host": plan.settings.ingress_host, **rule}
    spec: KubeObject = {"ingressClassName": plan.settings.ingress_class, "rules": [rule]}
    tls = _ingress_tls(plan)
    if tls:
        spec["tls"] = tls
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": plan.meta(plan.names.job, annotations=_ingress_annotations(plan)),
        "spec": spec,
    }


def disruption_budget(plan: _Plan) -> KubeObject:
    """One pod at a time, whatever the count: maxUnavailable follows the HPA, where a fixed
    minAvailable would block node drains at the minimum; pods that never got ready (a model
    that does not load) may always be evicted."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": plan.meta(plan.names.job),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": plan.selector},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def autoscaler(plan: _Plan) -> KubeObject:
    """Waiting requests per pod (a queue means the pods are full), with CPU as the fallback: the
    HPA takes the larger of the two, and where one cannot be read it still scales up on the
    other (it then skips scaling down, Kubernetes' rule for a missing metric)."""
    settings = plan.settings
    lo, hi = settings.replica_range()
    cpu = {
        "type": "Resource",
        "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": settings.cpu_target}},
    }
    queue = {
        "type": "Pods",
        "pods": {
            "metric": {"name": QUEUE_METRIC},
            "target": {"type": "AverageValue", "averageValue": str(settings.queue_target)},
        },
    }
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": plan.meta(plan.names.job, AUTOSCALING_COMPONENT),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": plan.names.job},
            "minReplicas": lo,
            "maxReplicas": hi,
            "metrics": [queue, cpu] if settings.autoscale == "queue" else [cpu],
            # a loaded pod is expensive to bring back: scale down slowly, one pod at a time
            "behavior": {
                "scaleDown": {
                    "stabilizationWindowSeconds": 600,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
                }
            },
        },
    }


def adapter_rule() -> KubeObject:
    """prometheus-adapter's rule: the gauge per pod, under a name Kubernetes accepts."""
    return {
        "seriesQuery": f'{WAITING_METRIC}{{namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{re.escape(WAITING_METRIC)}$", "as": QUEUE_METRIC},
        "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
    }


def adapter_rule_data() -> dict[str, str]:
    """The rule twice: in the adapter's own config file (under `rules:`) and as values of the
    prometheus-community/prometheus-adapter Helm chart (`rules.custom`)."""
    rule = adapter_rule()

    def dump(data: KubeObject) -> str:
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=200)

    return {"rules.yaml": dump({"rules": [rule]}), "helm-values.yaml": dump({"rules": {"custom": [rule]}})}


def adapter_rule_config_map(plan: _Plan) -> KubeObject:
    """`adapter_rule_data` as a ConfigMap. Merge it into the adapter's configuration; applying
    this ConfigMap alone configures nothing."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": plan.meta(f"{plan.names.job}-prometheus-adapter-rule", AUTOSCALING_COMPONENT),
        "data": adapter_rule_data(),
    }


# ---------------------------------------------------------------------------------- render


def _warnings(plan: _Plan) -> list[str]:
    k8s, settings = plan.k8s, plan.settings
    out = []
    if plan.engine == "native" and k8s.profile != "cpu":
        out.append(
            f"the native engine runs on CPUs and would leave this {k8s.profile} pod's accelerators idle; "
            "--engine vllm serves with them (tensor parallel over all of them)"
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
    return out + _access_warnings(settings)


def _access_warnings(settings: ServeSettings) -> list[str]:
    if not settings.api_key_secret:
        return ["no --api-key-secret: whoever reaches the Ingress or the Service can use the model"]
    if not (settings.ingress_tls_secret or settings.cert_manager_issuer):
        clear = "the API key crosses the network to the Ingress in clear text: add --ingress-tls-secret or "
        return [clear + "--cert-manager-issuer (with --ingress-host)"]
    return []


def render_serve(
    recipe: Recipe, settings: ServeSettings, hf_token: str | None = None, local_run: Path | None = None
) -> Rendered:
    """The serving objects of the run `recipe` describes (k8s.profile already applied), in apply order."""
    problems = settings.problems() + pod_resource_problems(recipe.k8s)
    if problems:
        raise RecipeError(*problems)
    plan = _plan(recipe, settings, local_run)
    out = [objects.namespace(plan.names)]
    if hf_token:
        out.append(objects.secret(plan.names, hf_token))
    if settings.network_policy:  # before the Deployment: no pod ever runs unguarded
        out.append(network_policy(plan))
    if settings.autoscale == "queue":
        out.append(adapter_rule_config_map(plan))
    out += [deployment(plan), service(plan), disruption_budget(plan)]
    if recipe.monitor.in_cluster:
        out.append(server_service_monitor(plan.names, recipe.monitor.release, SERVER_COMPONENT))
    if settings.autoscale != "off":
        out.append(autoscaler(plan))
    out.append(ingress(plan))
    if hf_token:
        _refuse_token_leak(out, hf_token)
    return Rendered(objects=out, names=plan.names, warnings=plan.warnings + _warnings(plan))
