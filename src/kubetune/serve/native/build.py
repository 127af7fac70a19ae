"""Build the native engine for `ServeOptions`: threads and dtype from the machine, the
models and adapters, the KV-cache budget from the container's memory, a warm-up pass."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from kubetune.contracts.engine import Limits
from kubetune.engine.core import Engine
from kubetune.engine.kvcache import SlotCache, register
from kubetune.errors import UserError
from kubetune.serve.native import host
from kubetune.serve.native.metrics import ServeMetrics
from kubetune.serve.native.models import ServedSet, load_served, plan_served
from kubetune.serve.native.packed import pack

KV_SHARE_OF_FREE = 0.5  # of the memory the container has left once the weights are in
KV_MAX_WITHOUT_LIMIT = 8 << 30  # a laptop or a pod without a limit: never more than this


DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32", "auto": "auto"}


def check_dtype(name: str) -> str:
    """`--dtype` as bf16 | fp32 | auto; never fp16 on CPU."""
    if name not in DTYPE_NAMES:
        raise UserError(f"--dtype {name}: choose auto, bf16 or fp32 (fp16 is not used on CPU: it is emulated and slow)")
    return DTYPE_NAMES[name]


def pick_dtype(name: str, config: Any) -> torch.dtype:
    """bf16 or fp32; `auto` is training's decision on this machine (kubetune.models.kernels:
    the model's shapes timed, cached, confirmed), not a second rule."""
    from kubetune.models.kernels import compute_precision

    precision = compute_precision(check_dtype(name), config, torch.device("cpu"))
    return torch.bfloat16 if precision == "bf16" else torch.float32


def kv_budget(explicit: int | None) -> int:
    """Bytes for the KV cache: as given, else half of what the container's limit leaves."""
    if explicit:
        return explicit
    import psutil

    used = psutil.Process().memory_info().rss
    limit = host.memory_limit()
    if limit:
        return max(64 << 20, int((limit - used) * KV_SHARE_OF_FREE))
    return max(64 << 20, min(KV_MAX_WITHOUT_LIMIT, int(host.available_memory() * KV_SHARE_OF_FREE)))


def build_engine(opts: Any) -> tuple[ServedSet, Engine, ServeMetrics, str]:
    """Load and warm up; the caller runs `engine.run()` on this same thread (see Engine.run)."""
    threads = opts.threads or host.threads()
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    remote = opts.trust_remote_code
    plan = plan_served(opts.target, list(opts.adapters), remote)
    dtype = pick_dtype(opts.dtype, plan.base_config())
    max_loras = getattr(opts, "max_loras", None)
    served = load_served(
        opts.target, list(opts.adapters), dtype, register(), trust_remote_code=remote, max_loras=max_loras
    )
    if getattr(opts, "served_model_names", ()):
        name_base(served, opts.served_model_names)
    config = served.lm.config
    limits = _limits(opts.limits, config)
    linear = pack(served.lm, rows=min(16, limits.max_num_seqs))
    cache = SlotCache.for_config(config, dtype, kv_budget(opts.kv_cache_bytes))
    max_lora = max_loras or len(served.adapter_names)
    metrics = ServeMetrics(served.base_name, max_lora, served.adapter_names, limits.max_model_len)
    if served.resident is not None:
        served.resident.metrics = metrics
        metrics.adapters_resident(len(served.resident.resident))
    if getattr(opts, "adapter_registry", None):
        register_from(served, opts.adapter_registry)
    engine = Engine(served.lm, served.tokenizer.eos_token_id, cache, served.lora, limits, metrics, served.resident)
    engine.warm_up()
    summary = (
        f"native engine serving {', '.join(served.models)} | "
        f"{str(dtype).removeprefix('torch.')}, {threads} thread(s) | "
        f"KV cache {cache.budget_tokens:,} tokens ({cache.budget_tokens * cache.token_bytes / 2**30:.2f} GiB), "
        f"<= {limits.max_num_seqs} running, <= {limits.max_waiting} waiting, context {limits.max_model_len} | {linear}"
    )
    return served, engine, metrics, summary


def register_from(served: ServedSet, registry_path: str) -> None:
    """`--adapter-registry`: its versions and aliases, served before /ready says so (the file was
    checked when the server started; a version that cannot load now stops the start, in one line)."""
    from pathlib import Path

    from kubetune.contracts.adapters import read_registry
    from kubetune.contracts.engine import AdapterRequestError

    path = Path(registry_path)
    if not path.exists():  # nothing registered yet (said at start)
        return
    try:
        served.register_registry(read_registry(path), path.parent)
    except AdapterRequestError as e:
        raise UserError(f"--adapter-registry {path}: {e.message}") from None


def name_base(served: ServedSet, names: tuple[str, ...]) -> None:
    """`--served-model-name`: the base model answers to these names (the first is the one
    adapters name as their parent and metrics label), instead of its recipe's."""
    base = served.models.pop(served.base_name)
    taken = sorted(set(names) & set(served.models))
    if taken:
        raise UserError(f"--served-model-name {taken[0]}: an adapter has that name; pick another")
    rest = served.models
    served.models = {n: dataclasses.replace(base, name=n) for n in names}
    for model in rest.values():
        model.parent = names[0]
    served.models.update(rest)
    served.base_name = names[0]


def _limits(limits: Limits, config: Any) -> Limits:
    """The context is never longer than the model's own."""
    model_max = int(getattr(config, "max_position_embeddings", limits.max_model_len) or limits.max_model_len)
    max_len = min(limits.max_model_len, model_max)
    return dataclasses.replace(
        limits, max_model_len=max_len, max_prompt_tokens=min(limits.max_prompt_tokens, max_len - 1)
    )
