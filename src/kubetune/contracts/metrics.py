"""The metric names kubetune's processes export and its dashboards and alerts read.

These names are a contract (README, "Monitoring"): dashboards, alerts and users' own panels
query them, so renaming one breaks them silently. Training metrics carry the labels
`job`, `rank` and `node` (TRAIN_LABELS); serving metrics keep vLLM's names (SERVE_METRICS) so
that one dashboard serves `kubetune serve` and vLLM alike.

Where they are served: a training pod's local-rank-0 process serves every rank of its pod on
`monitor.port` (prometheus-client's multiprocess mode aggregates the ranks' values; each
rank's series keeps its own `rank` label); a server serves them on its HTTP port
(`kubetune.contracts.serving.METRICS_PATH`).

Every exporter (training, serving, the device plugin, the scheduler extender) makes its
prometheus_client objects from these rows with `instrument`, so a name, help text, label or
bucket is written once. The module stays stdlib-only at import: the torch-free renderers
import it, and only `instrument` imports prometheus_client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["gauge", "counter", "histogram"]

# A training pod's metrics port when monitoring is on (`monitor.port`; the container port is named
# METRICS_PORT_NAME, which the PodMonitor selects).
DEFAULT_TRAIN_PORT = 9450
METRICS_PORT_NAME = "metrics"
METRICS_PATH = "/metrics"
# kube-prometheus-stack's Prometheus selects PodMonitors, ServiceMonitors and PrometheusRules by
# the label `release: <its Helm release name>`; an object without it is ignored without a word.
RELEASE_LABEL = "release"
DEFAULT_RELEASE = "kube-prometheus-stack"
# The kube-prometheus-stack Grafana sidecar loads ConfigMaps carrying this label as dashboards.
DASHBOARD_LABEL = ("grafana_dashboard", "1")

TRAIN_LABELS = ("job", "rank", "node")
# a GRPO step samples its generation (rollout) where the others read their data
STEP_PHASES = ("data", "rollout", "compute", "communication", "optimizer")
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "barrier", "broadcast")
# size_bucket label values of kubetune_collective_seconds: the message size rounded up to one of
# these (bytes), so that latency is compared between messages of like size.
COLLECTIVE_SIZE_BUCKETS = (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26, 1 << 28)


@dataclass(frozen=True)
class Metric:
    name: str  # as exposed; a counter is exposed with `_total`, a histogram with `_bucket`/`_sum`/`_count`
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: str = ""  # a histogram's bucket family (BUCKETS; bucket_bounds)


def _train(name: str, kind: Kind, help: str, extra: tuple[str, ...] = (), buckets: str = "") -> Metric:
    return Metric(name, kind, help, TRAIN_LABELS + extra, buckets)


TRAIN_METRICS: tuple[Metric, ...] = (
    # progress
    _train("kubetune_train_step", "gauge", "Optimizer steps done."),
    _train("kubetune_train_total_steps", "gauge", "Optimizer steps the run plans."),
    _train("kubetune_train_epoch", "gauge", "Epochs done (fractional)."),
    _train("kubetune_train_progress_ratio", "gauge", "step / total_steps."),
    _train("kubetune_train_eta_seconds", "gauge", "Estimated seconds to the last step at this run's rate."),
    # learning
    _train("kubetune_train_loss", "gauge", "Training loss of the last step (nats per target token)."),
    _train("kubetune_train_eval_loss", "gauge", "Loss on the eval split at the last evaluation."),
    _train(
        "kubetune_train_preference",
        "gauge",
        "Preference objectives (dpo, orpo, simpo): TRL's metrics, by their names, of the last logged step "
        "(metric=rewards/accuracies, rewards/margins, ...) and of the last evaluation (eval_rewards/accuracies, ...).",
        ("metric",),
    ),
    _train(
        "kubetune_train_rl",
        "gauge",
        "GRPO: TRL's metrics, by their names, of the last logged step (metric=reward, rewards/<func>/mean, kl, "
        "entropy, clip_ratio/region_mean, completions/mean_length, ...) and of the last evaluation (eval_reward, "
        "eval_accuracy, ...).",
        ("metric",),
    ),
    _train("kubetune_train_learning_rate", "gauge", "Learning rate of the last step."),
    _train("kubetune_train_grad_norm", "gauge", "Gradient norm before clipping, last step."),
    _train("kubetune_train_nonfinite_steps_total", "counter", "Steps whose loss or gradient was not finite."),
    # speed
    _train("kubetune_train_tokens_total", "counter", "Tokens trained on, this rank's share (ranks sum to the job)."),
    _train("kubetune_train_tokens_per_second", "gauge", "Tokens per second, this rank's share (ranks sum to the job)."),
    _train("kubetune_train_mfu_ratio", "gauge", "Model FLOPs per second over the device's peak (0-1)."),
    _train("kubetune_train_step_seconds", "histogram", "Step time by phase.", ("phase",), "step_seconds"),
    # communication
    _train(
        "kubetune_collective_seconds",
        "histogram",
        "Collective latency, issue to completion.",
        ("op", "size_bucket"),
        "collective_seconds",
    ),
    _train("kubetune_collective_bytes_total", "counter", "Bytes sent through collectives.", ("op",)),
    # health
    _train(
        "kubetune_train_memory_bytes",
        "gauge",
        "Memory the memory guard counts: the pod's unreclaimable memory (cgroup), else this process's RSS.",
    ),
    _train(
        "kubetune_train_memory_budget_bytes",
        "gauge",
        "What that memory may reach: KUBETUNE_MEMORY_BUDGET, else the cgroup limit, else the host's memory.",
    ),
    _train("kubetune_checkpoint_seconds", "histogram", "Time to save a checkpoint.", buckets="checkpoint_seconds"),
    _train("kubetune_checkpoint_last_timestamp_seconds", "gauge", "Unix time of the last saved checkpoint."),
    _train(
        "kubetune_train_restarts_total",
        "counter",
        "Restarts of the run so far (resumes from a checkpoint); increase() counts them across restarts.",
    ),
)

# `kubetune serve` and vLLM: vLLM V1's own series (vllm/v1/metrics/loggers.py, PrometheusStatLogger,
# as of vLLM 0.32), with its names, types, help texts, labels and buckets, because KServe, llm-d's
# scheduler, the Gateway API Inference Extension's endpoint picker and KEDA scale and route on them.
# kubetune.serve.native.metrics builds its prometheus_client objects from this table; nothing else lists them.
# `engine` is vLLM's engine index (data-parallel rank): a kubetune server is one engine, "0".
SERVE_LABELS = ("model_name", "engine")
SERVE_ENGINE = "0"
# vLLM's FinishReason as it prints it (vllm/v1/engine/__init__.py FINISH_REASON_STRINGS): stop (EOS,
# a stop token or a stop string), length (max_tokens or the context), abort (the client went
# away), error (a request-level failure), repetition (vLLM's repetition detector; never here).
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
LORA_INFO_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")

# Histogram bucket families, by the name a row gives in `buckets`: kubetune's own, then vLLM's
# (vllm/v1/metrics/buckets.py), whose "request_tokens" is its 1-2-5 series up to the server's
# context length (bucket_bounds).
BUCKETS: dict[str, tuple[float, ...]] = {
    "step_seconds": (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300),
    "collective_seconds": (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
    "checkpoint_seconds": (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
    "adapter_load_seconds": (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    "extender_seconds": (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
    "request_latency": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
    "time_to_first_token": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "inter_token_latency": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                            7.5, 10.0, 20.0, 40.0, 80.0),
}  # fmt: skip


def _serve(name: str, kind: Kind, help: str, buckets: str = "") -> Metric:
    return Metric(name, kind, help, SERVE_LABELS, buckets)


SERVE_METRICS: tuple[Metric, ...] = (
    # scheduler state (gauges, set every engine turn)
    _serve("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    _serve("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    _serve("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    # counters, in tokens or requests
    _serve("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens."),
    _serve("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."),
    _serve("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
    _serve("vllm:generation_tokens", "counter", "Number of generation tokens processed."),
    Metric(
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
        (*SERVE_LABELS, "finished_reason"),
    ),
    # per token
    _serve(
        "vllm:time_to_first_token_seconds",
        "histogram",
        "Histogram of time to first token in seconds.",
        "time_to_first_token",
    ),
    _serve(
        "vllm:inter_token_latency_seconds",
        "histogram",
        "Histogram of inter-token latency in seconds.",
        "inter_token_latency",
    ),
    # per request, observed when it finishes
    _serve("vllm:request_prompt_tokens", "histogram", "Number of prefill tokens processed.", "request_tokens"),
    _serve("vllm:request_generation_tokens", "histogram", "Number of generation tokens processed.", "request_tokens"),
    _serve(
        "vllm:request_time_per_output_token_seconds",
        "histogram",
        "Histogram of time_per_output_token_seconds per request.",
        "inter_token_latency",
    ),
    _serve(
        "vllm:e2e_request_latency_seconds",
        "histogram",
        "Histogram of e2e request latency in seconds.",
        "request_latency",
    ),
    _serve(
        "vllm:request_queue_time_seconds",
        "histogram",
        "Histogram of time spent in WAITING phase for request.",
        "request_latency",
    ),
    _serve(
        "vllm:request_inference_time_seconds",
        "histogram",
        "Histogram of time spent in RUNNING phase for request.",
        "request_latency",
    ),
    _serve(
        "vllm:request_prefill_time_seconds",
        "histogram",
        "Histogram of time spent in PREFILL phase for request.",
        "request_latency",
    ),
    _serve(
        "vllm:request_decode_time_seconds",
        "histogram",
        "Histogram of time spent in DECODE phase for request.",
        "request_latency",
    ),
    # adapters (vLLM: only with --enable-lora; value: the time of the last change)
    Metric("vllm:lora_requests_info", "gauge", "Running stats on lora requests.", LORA_INFO_LABELS),
    # kubetune's own, beside vLLM's: adapters loaded into and evicted from the layers (--max-loras)
    _serve(
        "kubetune:lora_adapter_load_seconds",
        "histogram",
        "Time to stack one adapter into the model's layers (at registration, or for a request under --max-loras).",
        "adapter_load_seconds",
    ),
    _serve(
        "kubetune:lora_adapter_evictions",
        "counter",
        "Adapters taken out of the layers to make room for another (--max-loras, least recently used first).",
    ),
    _serve("kubetune:lora_adapters_resident", "gauge", "Adapters in the model's layers now (at most --max-loras)."),
)


def bucket_bounds(metric: Metric, max_model_len: int | None = None) -> tuple[float, ...]:
    """A histogram's bucket bounds; a token-count histogram's, as vLLM draws them for a server of `max_model_len`."""
    if metric.buckets == "request_tokens":
        if max_model_len is None:
            raise ValueError(f"{metric.name}: its buckets depend on the server's max_model_len")
        return _one_two_five(max_model_len)
    return BUCKETS[metric.buckets]


def _one_two_five(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's build_1_2_5_buckets)."""
    bounds: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(bounds)
            bounds.append(float(mantissa * scale))
        scale *= 10


# kubetune's cluster components (kubetune.cluster): the device plugin and the scheduler extender,
# which build their metrics from this table.
COMPONENT_METRICS: tuple[Metric, ...] = (
    Metric(
        "kubetune_deviceplugin_devices", "gauge", "Cards advertised to the kubelet, by health.", ("resource", "health")
    ),
    Metric("kubetune_deviceplugin_allocations", "counter", "Containers given cards by Allocate.", ("resource",)),
    Metric("kubetune_deviceplugin_allocated_devices", "counter", "Cards handed out by Allocate.", ("resource",)),
    Metric(
        "kubetune_deviceplugin_allocate_errors",
        "counter",
        "Allocate calls refused (unknown or unhealthy ids).",
        ("resource",),
    ),
    Metric(
        "kubetune_deviceplugin_driver_present",
        "gauge",
        "1 when the node's driver answers; 0 while the plugin waits for it, advertising 0 cards.",
        ("resource",),
    ),
    Metric(
        "kubetune_deviceplugin_registrations", "counter", "Successful Register calls to the kubelet.", ("resource",)
    ),
    Metric(
        "kubetune_extender_request_seconds",
        "histogram",
        "Time to answer a scheduler call, parse included.",
        ("verb", "code"),
        "extender_seconds",
    ),
)


def component_metric(name: str) -> Metric:
    """The contract's entry for one of the cluster components' metrics."""
    (metric,) = [m for m in COMPONENT_METRICS if m.name == name]
    return metric


def instrument(
    metric: Metric,
    registry: Any,
    *,
    max_model_len: int | None = None,
    gauge_mode: Literal["all", "mostrecent"] = "all",
) -> Any:
    """`metric` as a prometheus_client Gauge, Counter or Histogram in `registry`, with the row's
    name, help text, label names and buckets. `gauge_mode`: how multiprocess mode combines the
    processes' values of a gauge (prometheus_client's multiprocess_mode)."""
    from prometheus_client import Counter, Gauge, Histogram

    labels = list(metric.labels)
    if metric.kind == "gauge":
        return Gauge(metric.name, metric.help, labels, registry=registry, multiprocess_mode=gauge_mode)
    if metric.kind == "counter":
        return Counter(metric.name, metric.help, labels, registry=registry)
    buckets = bucket_bounds(metric, max_model_len)
    return Histogram(metric.name, metric.help, labels, registry=registry, buckets=buckets)


def exposed_names(metric: Metric) -> tuple[str, ...]:
    """The series names Prometheus stores for `metric` (what a PromQL expression may name)."""
    if metric.kind == "counter":
        base = metric.name.removesuffix("_total")
        return (f"{base}_total",)
    if metric.kind == "histogram":
        return tuple(f"{metric.name}{s}" for s in ("_bucket", "_sum", "_count"))
    return (metric.name,)


def size_bucket(nbytes: int) -> str:
    """The `size_bucket` label of a collective of `nbytes`: the smallest bucket bound that holds it."""
    for bound in COLLECTIVE_SIZE_BUCKETS:
        if nbytes <= bound:
            return _human(bound)
    return f">{_human(COLLECTIVE_SIZE_BUCKETS[-1])}"


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift}{unit}"
    return f"{n}B"
