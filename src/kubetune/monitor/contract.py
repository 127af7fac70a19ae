"""The metric names kubetune's processes export and its dashboards and alerts read.

These names are a contract (README, "Monitoring"): dashboards, alerts and users' own panels
query them, so renaming one breaks them silently. Training metrics carry the labels
`job`, `rank` and `node` (TRAIN_LABELS); serving metrics keep vLLM's names (SERVE_METRICS) so
that one dashboard serves `kubetune serve` and vLLM alike.

Where they are served: a training pod's local-rank-0 process serves every rank of its pod on
`monitor.port` (prometheus-client's multiprocess mode aggregates the ranks' values; each
rank's series keeps its own `rank` label); a server serves them on its HTTP port
(`kubetune.serve.contract.METRICS_PATH`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
STEP_PHASES = ("data", "compute", "communication", "optimizer")
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "barrier", "broadcast")
# size_bucket label values of kubetune_collective_seconds: the message size rounded up to one of
# these (bytes), so that latency is compared between messages of like size.
COLLECTIVE_SIZE_BUCKETS = (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26, 1 << 28)

STEP_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
COLLECTIVE_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)
CHECKPOINT_SECONDS_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass(frozen=True)
class Metric:
    name: str  # as exposed; a counter is exposed with `_total`, a histogram with `_bucket`/`_sum`/`_count`
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()


def _train(name: str, kind: Kind, help: str, extra: tuple[str, ...] = ()) -> Metric:
    return Metric(name, kind, help, TRAIN_LABELS + extra)


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
    _train("kubetune_train_learning_rate", "gauge", "Learning rate of the last step."),
    _train("kubetune_train_grad_norm", "gauge", "Gradient norm before clipping, last step."),
    _train("kubetune_train_nonfinite_steps_total", "counter", "Steps whose loss or gradient was not finite."),
    # speed
    _train("kubetune_train_tokens_total", "counter", "Tokens trained on, this rank's share (ranks sum to the job)."),
    _train("kubetune_train_tokens_per_second", "gauge", "Tokens per second, this rank's share (ranks sum to the job)."),
    _train("kubetune_train_mfu_ratio", "gauge", "Model FLOPs per second over the device's peak (0-1)."),
    _train("kubetune_train_step_seconds", "histogram", "Step time by phase.", ("phase",)),
    # communication
    _train(
        "kubetune_collective_seconds", "histogram", "Collective latency, issue to completion.", ("op", "size_bucket")
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
    _train("kubetune_checkpoint_seconds", "histogram", "Time to save a checkpoint."),
    _train("kubetune_checkpoint_last_timestamp_seconds", "gauge", "Unix time of the last saved checkpoint."),
    _train(
        "kubetune_train_restarts_total",
        "counter",
        "Restarts of the run so far (resumes from a checkpoint); increase() counts them across restarts.",
    ),
)

# `kubetune serve` and vLLM (kubetune.serve.metrics defines them; label model_name).
SERVE_METRICS: tuple[Metric, ...] = (
    Metric("vllm:num_requests_running", "gauge", "Requests in the running batch.", ("model_name",)),
    Metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be admitted.", ("model_name",)),
    Metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage, 1 = full.", ("model_name",)),
    Metric("vllm:prompt_tokens", "counter", "Prompt tokens read.", ("model_name",)),
    Metric("vllm:generation_tokens", "counter", "Tokens generated.", ("model_name",)),
    Metric("vllm:request_success", "counter", "Requests finished, by reason.", ("model_name", "finished_reason")),
    Metric("vllm:time_to_first_token_seconds", "histogram", "Time to first token.", ("model_name",)),
    Metric("vllm:inter_token_latency_seconds", "histogram", "Time between tokens.", ("model_name",)),
    Metric("vllm:e2e_request_latency_seconds", "histogram", "Request latency.", ("model_name",)),
    Metric("vllm:request_queue_time_seconds", "histogram", "Time queued before running.", ("model_name",)),
    Metric("vllm:lora_requests_info", "gauge", "Adapters running and waiting.", ()),
)

# kubetune's cluster components (kubetune.cluster): the device plugin and the scheduler extender.
COMPONENT_METRICS: tuple[Metric, ...] = (
    Metric("kubetune_deviceplugin_devices", "gauge", "Cards advertised, by health.", ("resource", "health")),
    Metric("kubetune_deviceplugin_allocations", "counter", "Containers given cards.", ("resource",)),
    Metric("kubetune_deviceplugin_allocated_devices", "counter", "Cards handed out.", ("resource",)),
    Metric("kubetune_deviceplugin_allocate_errors", "counter", "Allocate calls refused.", ("resource",)),
    Metric("kubetune_deviceplugin_driver_present", "gauge", "1 when the driver answers.", ("resource",)),
    Metric("kubetune_deviceplugin_registrations", "counter", "Register calls to the kubelet.", ("resource",)),
    Metric("kubetune_extender_request_seconds", "histogram", "Scheduler call latency.", ("verb", "code")),
)


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
