"""kubetune's three Grafana dashboards, built from one definition each (`kubetune.monitor.grafana`).

- training: progress and ETA, loss, tokens/s per rank, MFU, step time by phase, collective
  latency p50/p99 by size and by rank, memory against budget, checkpoints, restarts;
- serving: requests/s, time to first token, inter-token, end-to-end latency and time per
  output token p50/p99, request phases, running and waiting requests, KV-cache use, tokens/s,
  prefix-cache hit rate, tokens per request, adapters (vLLM's names: the same dashboard reads
  `kubetune serve` and vLLM);
- nodes and accelerators: node-exporter and cAdvisor CPU/memory/network, Intel Gaudi (Intel's
  metric exporter), NVIDIA (DCGM exporter), and kubetune's device plugin and scheduler extender.

Panels name only metrics of `kubetune.contracts.metrics` or of the exporters listed in
`kubetune.monitor.exporters` (a test holds this). The JSON files in `monitor/dashboards/`
are `write_json`'s output, for users who import them by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kubetune.monitor.grafana import Dashboard, Panel, Row, Target, Variable
from kubetune.monitor.rules import restarts

JSON_DIR = Path(__file__).with_name("dashboards")
RATE = "$__rate_interval"  # Grafana's: at least four scrape intervals, so rate() always has samples
TRAIN = '{namespace=~"$namespace", job=~"$job"}'
SERVE = '{namespace=~"$namespace", model_name=~"$model"}'
NS = '{namespace=~"$namespace"}'
DATASOURCE = Variable("datasource", "Data source", kind="datasource")
NAMESPACE = Variable("namespace", "Namespace", "label_values(kubetune_train_step, namespace)")


def _t(expr: str, legend: str = "") -> Target:
    return Target(expr, legend)


def _p(title: str, *targets: Target, **options: Any) -> Panel:
    return Panel(title, targets, **options)


def _quantiles(metric: str, by: str, selector: str, legend: str) -> tuple[Target, ...]:
    """p50 and p99 of a histogram, per `by`."""
    rate = f"rate({metric}_bucket{selector}[{RATE}])"
    return tuple(
        _t(f"histogram_quantile({q}, sum by ({by}, le) ({rate}))", f"p{round(q * 100)} {legend}") for q in (0.5, 0.99)
    )


# ---------------------------------------------------------------------------------- training


def _progress() -> Row:
    return Row(
        "Progress",
        (
            _p("Progress", _t(f"max by (job) (kubetune_train_progress_ratio{TRAIN})", "{{job}}"),
               kind="gauge", unit="percentunit", min=0, max=1, width=6),
            _p("Time left (ETA)", _t(f"max by (job) (kubetune_train_eta_seconds{TRAIN})", "{{job}}"),
               kind="stat", unit="s", width=6),
            _p("Epoch", _t(f"max by (job) (kubetune_train_epoch{TRAIN})", "{{job}}"), kind="stat", width=4),
            _p("Step of total",
               _t(f"max by (job) (kubetune_train_step{TRAIN})", "step {{job}}"),
               _t(f"max by (job) (kubetune_train_total_steps{TRAIN})", "total {{job}}"), width=8),
        ),
    )  # fmt: skip


def _learning() -> Row:
    return Row(
        "Learning",
        (
            _p("Loss and eval loss",
               _t(f"avg by (job) (kubetune_train_loss{TRAIN})", "train {{job}}"),
               _t(f"avg by (job) (kubetune_train_eval_loss{TRAIN})", "eval {{job}}"),
               description="Nats per target token; eval loss at each evaluation.", width=10),
            _p("Learning rate", _t(f"max by (job) (kubetune_train_learning_rate{TRAIN})", "{{job}}"), width=5),
            _p("Gradient norm (before clipping)", _t(f"max by (job) (kubetune_train_grad_norm{TRAIN})", "{{job}}"),
               width=5),
            _p("Non-finite steps", _t(f"sum by (job) (kubetune_train_nonfinite_steps_total{TRAIN})", "{{job}}"),
               kind="stat", red_above=1, width=4),
        ),
    )  # fmt: skip


def _preference() -> Row:
    pref = "kubetune_train_preference"
    return Row(
        "Preference (dpo, orpo, simpo)",
        (
            _p("Reward accuracy (train, eval)",
               _t(f'avg by (job) ({pref}{{metric="rewards/accuracies",{TRAIN[1:]})', "train {{job}}"),
               _t(f'avg by (job) ({pref}{{metric="eval_rewards/accuracies",{TRAIN[1:]})', "eval {{job}}"),
               description="TRL's rewards/accuracies: the share of pairs whose chosen answer's reward is the higher.",
               unit="percentunit", min=0, max=1, width=12),
            _p("Rewards and margin",
               *(_t(f'avg by (job) ({pref}{{metric="rewards/{m}",{TRAIN[1:]})', f"{m} {{{{job}}}}")
                 for m in ("chosen", "rejected", "margins")),
               description="TRL's rewards/chosen, rewards/rejected and rewards/margins of the last logged step.",
               width=12),
        ),
    )  # fmt: skip


def _rl() -> Row:
    rl = "kubetune_train_rl"

    def series(metric: str, legend: str) -> Any:
        return _t(f'avg by (job) ({rl}{{metric="{metric}",{TRAIN[1:]})', f"{legend} {{{{job}}}}")

    return Row(
        "Online RL (grpo)",
        (
            _p("Reward (train, held out)", series("reward", "train"), series("eval_reward", "eval"),
               series("eval_accuracy", "eval accuracy"),
               description="TRL's reward: the mean weighted reward of the last logged step's completions; eval_reward "
               "and eval_accuracy: greedy completions of the held-out prompts at each evaluation.", width=8),
            _p("KL, entropy, clipped", series("kl", "kl"), series("entropy", "entropy"),
               series("clip_ratio/region_mean", "clipped"),
               description="KL to the reference (beta > 0), the policy's entropy and the share of clipped tokens.",
               width=8),
            _p("Completions", series("completions/mean_length", "mean length"),
               series("completions/clipped_ratio", "cut at max length"), series("frac_reward_zero_std", "no signal"),
               description="Mean completion length in tokens; the shares cut at max_completion_length and of groups "
               "whose rewards were all equal (no advantage).", width=8),
        ),
    )  # fmt: skip


def _speed() -> Row:
    step = "kubetune_train_step_seconds"
    seconds, steps = (f"sum by (job, phase) (rate({step}_{part}{TRAIN}[{RATE}]))" for part in ("sum", "count"))
    phase_mean = f"{seconds} / {steps}"
    return Row(
        "Speed",
        (
            _p("Tokens/s per rank",
               _t(f"sum by (job, rank) (kubetune_train_tokens_per_second{TRAIN})", "rank {{rank}}"), width=8),
            _p("Tokens/s, whole job", _t(f"sum by (job) (rate(kubetune_train_tokens_total{TRAIN}[{RATE}]))", "{{job}}"),
               width=6),
            _p("MFU", _t(f"avg by (job) (kubetune_train_mfu_ratio{TRAIN})", "{{job}}"),
               description="Model FLOPs per second over the accelerators' peak.",
               kind="gauge", unit="percentunit", min=0, max=1, width=4),
            _p("Step time by phase (mean)", _t(phase_mean, "{{phase}}"), unit="s", stack=True, width=6,
               description="Data, compute, communication and optimizer time of a step; stacked = the step."),
            _p("Step time p99 by phase", *_quantiles(step, "job, phase", TRAIN, "{{phase}}")[1:], unit="s",
               width=8),
        ),
    )  # fmt: skip


def _communication() -> Row:
    coll = "kubetune_collective_seconds"
    return Row(
        "Communication",
        (
            _p("Collective latency by size, p50 / p99", *_quantiles(coll, "job, op, size_bucket", TRAIN,
               "{{op}} {{size_bucket}}"), unit="s", width=12,
               description="Issue to completion of each all-reduce / all-gather / reduce-scatter, by message size."),
            _p("Collective latency p99 by rank", *_quantiles(coll, "job, rank", TRAIN, "rank {{rank}}")[1:], unit="s",
               description="A rank far above the others is a straggler: look at its node.", width=6),
            _p("Collective bandwidth",
               _t(f"sum by (job, op) (rate(kubetune_collective_bytes_total{TRAIN}[{RATE}]))", "{{op}}"),
               unit="Bps", width=6),
        ),
    )  # fmt: skip


def _health() -> Row:
    ckpt = "kubetune_checkpoint_seconds"
    restarts_24h = restarts("24h").replace("_total[", f"_total{TRAIN}[")
    return Row(
        "Health",
        (
            _p("Memory against budget",
               _t(f"max by (job, rank) (kubetune_train_memory_bytes{TRAIN})", "used rank {{rank}}"),
               _t(f"max by (job) (kubetune_train_memory_budget_bytes{TRAIN})", "budget"), unit="bytes", width=8),
            _p("Memory / budget",
               _t(f"max by (job) (kubetune_train_memory_bytes{TRAIN} / kubetune_train_memory_budget_bytes{TRAIN})",
                  "{{job}}"), kind="gauge", unit="percentunit", min=0, max=1, red_above=0.97, width=4),
            _p("Checkpoint save time (mean)",
               _t(f"sum by (job) ({ckpt}_sum{TRAIN}) / sum by (job) ({ckpt}_count{TRAIN})", "{{job}}"),
               kind="stat", unit="s", width=3),
            _p("Checkpoints saved", _t(f"max by (job) ({ckpt}_count{TRAIN})", "{{job}}"), kind="stat", width=3),
            _p("Since last checkpoint",
               _t(f"time() - max by (job) (kubetune_checkpoint_last_timestamp_seconds{TRAIN})", "{{job}}"),
               kind="stat", unit="s", width=3),
            _p("Restarts (last 24h)", _t(f"sum by (job) {restarts_24h}", "{{job}}"), kind="stat", red_above=1,
               description="Process restarts of all ranks: torchrun's worker restarts and container restarts.",
               width=3),
        ),
    )  # fmt: skip


def training() -> Dashboard:
    job = Variable("job", "Job", 'label_values(kubetune_train_step{namespace=~"$namespace"}, job)')
    return Dashboard(
        "kubetune-training",
        "kubetune / Training",
        "A fine-tune's progress, loss, speed, communication and health (kubetune_* metrics of the training pods).",
        (DATASOURCE, NAMESPACE, job),
        (_progress(), _learning(), _preference(), _rl(), _speed(), _communication(), _health()),
    )


# ---------------------------------------------------------------------------------- serving


def _serve_latency() -> Row:
    by = "model_name"
    return Row(
        "Latency",
        (
            _p("Time to first token", *_quantiles("vllm:time_to_first_token_seconds", by, SERVE, "{{model_name}}"),
               unit="s", width=8),
            _p("Inter-token latency", *_quantiles("vllm:inter_token_latency_seconds", by, SERVE, "{{model_name}}"),
               unit="s", width=8),
            _p("End-to-end latency", *_quantiles("vllm:e2e_request_latency_seconds", by, SERVE, "{{model_name}}"),
               unit="s", width=8),
            _p("Time per output token",
               *_quantiles("vllm:request_time_per_output_token_seconds", by, SERVE, "{{model_name}}"),
               description="Per request: first token to last over the tokens after the first (vLLM's).",
               unit="s", width=8),
            _p("Request phases p99",
               *(_quantiles(f"vllm:request_{phase}_time_seconds", by, SERVE, f"{phase} {{{{model_name}}}}")[1]
                 for phase in ("prefill", "decode", "inference")),
               description="Prefill: admission to first token; decode: first token to last; inference: both.",
               unit="s", width=16),
        ),
    )  # fmt: skip


def _serve_load() -> Row:
    return Row(
        "Load",
        (
            _p("Requests/s by finish reason",
               _t(f"sum by (model_name, finished_reason) (rate(vllm:request_success_total{SERVE}[{RATE}]))",
                  "{{model_name}} {{finished_reason}}"), unit="reqps", width=8),
            _p("Running and waiting requests",
               _t(f"sum by (model_name) (vllm:num_requests_running{SERVE})", "running {{model_name}}"),
               _t(f"sum by (model_name) (vllm:num_requests_waiting{SERVE})", "waiting {{model_name}}"), width=8),
            _p("KV-cache use", _t(f"max by (model_name) (vllm:kv_cache_usage_perc{SERVE})", "{{model_name}}"),
               kind="gauge", unit="percentunit", min=0, max=1, red_above=0.95, width=4),
            _p("Queue time p99", *_quantiles("vllm:request_queue_time_seconds", "model_name", SERVE,
               "{{model_name}}")[1:], unit="s", width=4),
        ),
    )  # fmt: skip


def _serve_tokens() -> Row:
    return Row(
        "Tokens and adapters",
        (
            _p("Tokens/s",
               _t(f"sum by (model_name) (rate(vllm:prompt_tokens_total{SERVE}[{RATE}]))", "prompt {{model_name}}"),
               _t(f"sum by (model_name) (rate(vllm:generation_tokens_total{SERVE}[{RATE}]))",
                  "generated {{model_name}}"), width=12),
            _p("Prefix-cache hit rate",
               _t(f"sum by (model_name) (rate(vllm:prefix_cache_hits_total{SERVE}[{RATE}])) / "
                  f"sum by (model_name) (rate(vllm:prefix_cache_queries_total{SERVE}[{RATE}]))", "{{model_name}}"),
               description="Prompt tokens restored from the prefix cache over prompt tokens looked up.",
               unit="percentunit", min=0, max=1, width=12),
            _p("Tokens per request",
               *_quantiles("vllm:request_prompt_tokens", "model_name", SERVE, "prompt {{model_name}}"),
               *_quantiles("vllm:request_generation_tokens", "model_name", SERVE, "generated {{model_name}}"),
               width=12),
            _p("Adapters running / waiting",
               _t(f"count by (running_lora_adapters, waiting_lora_adapters) (vllm:lora_requests_info{NS})",
                  "running: {{running_lora_adapters}} waiting: {{waiting_lora_adapters}}"),
               description="The LoRA adapters of the running and the waiting requests (kubetune serve --adapter, "
               "vLLM --lora-modules).", width=12),
            _p("Adapter slots (--max-loras)",
               _t(f"sum by (model_name) (kubetune:lora_adapters_resident{SERVE})", "resident {{model_name}}"),
               _t(f"sum by (model_name) (rate(kubetune:lora_adapter_evictions_total{SERVE}[{RATE}]))",
                  "evictions/s {{model_name}}"),
               *_quantiles("kubetune:lora_adapter_load_seconds", "model_name", SERVE, "load {{model_name}}"),
               description="kubetune serve only: adapters in the layers, evictions to make room, and the time "
               "to load one; many evictions per request: raise --max-loras.", width=12),
        ),
    )  # fmt: skip


def serving() -> Dashboard:
    model = Variable("model", "Model", 'label_values(vllm:num_requests_running{namespace=~"$namespace"}, model_name)')
    namespace = Variable("namespace", "Namespace", "label_values(vllm:num_requests_running, namespace)")
    return Dashboard(
        "kubetune-serving",
        "kubetune / Serving",
        "kubetune serve and vLLM servers: load, latency, KV cache, tokens (vllm:* metrics).",
        (DATASOURCE, namespace, model),
        (_serve_load(), _serve_latency(), _serve_tokens()),
    )


# ---------------------------------------------------------------------------------- nodes


def _nodes() -> Row:
    cpu = f'1 - avg by (instance) (rate(node_cpu_seconds_total{{mode="idle"}}[{RATE}]))'
    memory = "1 - node_memory_MemAvailable_bytes / node_memory_MemTotal_bytes"
    pod = '{namespace=~"$namespace", container!=""}'
    return Row(
        "Nodes and pods (node-exporter, cAdvisor)",
        (
            _p("Node CPU busy", _t(cpu, "{{instance}}"), unit="percentunit", min=0, max=1, width=6),
            _p("Node memory used", _t(memory, "{{instance}}"), unit="percentunit", min=0, max=1, width=6),
            _p("Node network",
               _t(f'sum by (instance) (rate(node_network_receive_bytes_total{{device!="lo"}}[{RATE}]))',
                  "rx {{instance}}"),
               _t(f'sum by (instance) (rate(node_network_transmit_bytes_total{{device!="lo"}}[{RATE}]))',
                  "tx {{instance}}"), unit="Bps", width=4),
            _p("Pod CPU (cores)",
               _t(f"sum by (namespace, pod) (rate(container_cpu_usage_seconds_total{pod}[{RATE}]))", "{{pod}}"),
               width=4),
            _p("Pod memory (working set)",
               _t(f"sum by (namespace, pod) (container_memory_working_set_bytes{pod})", "{{pod}}"), unit="bytes",
               width=4),
        ),
    )  # fmt: skip


def _gaudi() -> Row:
    return Row(
        "Intel Gaudi (Intel's metric exporter)",
        (
            _p("Gaudi utilization", _t("habanalabs_utilization", "{{instance}} {{UUID}}"), unit="percent",
               min=0, max=100, width=6),
            _p("Gaudi memory used",
               _t("habanalabs_memory_used_bytes / habanalabs_memory_total_bytes", "{{instance}} {{UUID}}"),
               unit="percentunit", min=0, max=1, width=6),
            _p("Gaudi power", _t("habanalabs_power_mW / 1000", "{{instance}} {{UUID}}"), unit="watt", width=6),
            _p("Gaudi temperature", _t("habanalabs_temperature_onchip", "{{instance}} {{UUID}}"), unit="celsius",
               width=6),
        ),
    )  # fmt: skip


def _nvidia() -> Row:
    return Row(
        "NVIDIA (DCGM exporter)",
        (
            _p("GPU utilization", _t("DCGM_FI_DEV_GPU_UTIL", "{{Hostname}} gpu {{gpu}}"), unit="percent",
               min=0, max=100, width=6),
            _p("GPU memory used",
               _t("DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE)", "{{Hostname}} gpu {{gpu}}"),
               unit="percentunit", min=0, max=1, width=6),
            _p("GPU power", _t("DCGM_FI_DEV_POWER_USAGE", "{{Hostname}} gpu {{gpu}}"), unit="watt", width=6),
            _p("GPU temperature", _t("DCGM_FI_DEV_GPU_TEMP", "{{Hostname}} gpu {{gpu}}"), unit="celsius", width=6),
        ),
    )  # fmt: skip


def _components() -> Row:
    extender = f"rate(kubetune_extender_request_seconds_bucket[{RATE}])"
    return Row(
        "kubetune device plugin and scheduler extender",
        (
            _p("Cards advertised by health", _t("sum by (resource, health) (kubetune_deviceplugin_devices)",
               "{{resource}} {{health}}"), width=6),
            _p("Driver present", _t("min by (instance) (kubetune_deviceplugin_driver_present)", "{{instance}}"),
               description="0 while a node's plugin waits for the driver (it then advertises no cards).",
               kind="stat", width=3),
            _p("Allocations/s (containers, cards)",
               _t(f"sum by (resource) (rate(kubetune_deviceplugin_allocations_total[{RATE}]))", "granted"),
               _t(f"sum by (resource) (rate(kubetune_deviceplugin_allocated_devices_total[{RATE}]))", "cards"),
               _t(f"sum by (resource) (rate(kubetune_deviceplugin_allocate_errors_total[{RATE}]))", "refused"),
               _t(f"sum by (resource) (rate(kubetune_deviceplugin_registrations_total[{RATE}]))", "registrations"),
               width=5),
            _p("Extender calls/s",
               _t(f"sum by (verb, code) (rate(kubetune_extender_request_seconds_count[{RATE}]))", "{{verb}} {{code}}"),
               unit="reqps", width=5),
            _p("Extender latency p99", _t(f"histogram_quantile(0.99, sum by (verb, le) ({extender}))", "{{verb}}"),
               unit="s", width=5),
        ),
    )  # fmt: skip


def nodes() -> Dashboard:
    namespace = Variable("namespace", "Namespace", "label_values(container_cpu_usage_seconds_total, namespace)")
    return Dashboard(
        "kubetune-nodes",
        "kubetune / Nodes and accelerators",
        "Nodes (node-exporter, cAdvisor), Gaudi and NVIDIA accelerators, kubetune's device plugin and extender.",
        (DATASOURCE, namespace),
        (_nodes(), _gaudi(), _nvidia(), _components()),
    )


def dashboards() -> tuple[Dashboard, ...]:
    return (training(), serving(), nodes())


def to_text(dashboard: Dashboard) -> str:
    return json.dumps(dashboard.to_json(), indent=2, sort_keys=False) + "\n"


def write_json(directory: Path = JSON_DIR) -> list[Path]:
    """Every dashboard as `<uid>.json` in `directory` (the package's copy by default)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for dashboard in dashboards():
        path = directory / f"{dashboard.uid}.json"
        path.write_text(to_text(dashboard), encoding="utf-8")
        written.append(path)
    return written
