"""The alerts: PromQL over the metric contract, as a Prometheus rule file.

Each alert pages for a problem a person has to act on, and says what to do: `summary` (one
line, which job), `description` (what the numbers say) and `runbook` (the commands to run
first). `signal` is the quantity an alert watches: it returns data whenever the metrics it
reads are scraped, which is how the tests (and `kubetune monitor check`) know an alert is not
blind, while `expr` returns data only when the alert is pending or firing.

Severity: `critical` pages (a job stopped learning, users wait), `warning` goes to a ticket
(something degrades and will need a fix). Thresholds live in `RuleSettings`; `rule_file`
is what `promtool check rules` reads, and `kubetune.monitor.objects` wraps the same groups in
a PrometheusRule.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubetune.contracts.kube import KubeObject

TRAIN = "namespace, job"
RANK = "namespace, job, rank"
SERVE = "namespace, model_name"
WHERE = "{{ $labels.namespace }}/{{ $labels.job }}"
STATUS = "`kubetune k8s status {{ $labels.job }} -n {{ $labels.namespace }}`"


@dataclass(frozen=True)
class RuleSettings:
    """Alert thresholds (defaults suit a fine-tune whose steps take seconds, not minutes)."""

    stall_minutes: int = 15  # no optimizer step for this long (at least 10)
    restarts_per_hour: int = 3
    memory_ratio: float = 0.97  # memory / budget
    collective_factor: float = 5.0  # a rank's p99 over the job's median, same op and size
    ttft_p99_seconds: float = 2.0


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str
    signal: str
    expr: str
    for_: str
    summary: str
    description: str
    runbook: str
    when: str  # the condition in words (docs/monitoring.md's alert table)
    group: str = "training"

    def rule(self) -> KubeObject:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description, "runbook": self.runbook},
        }


def _stalled(s: RuleSettings) -> Alert:
    # changes() over 5 minutes, held for the rest: a job younger than the window (a constant
    # step reads "no change") must also wait out `for` before it pages.
    signal = f"max by ({TRAIN}) (changes(kubetune_train_step[5m]))"
    finished = f"max by ({TRAIN}) (kubetune_train_step >= kubetune_train_total_steps)"
    return Alert(
        "KubetuneTrainingStalled",
        "critical",
        signal,
        f"{signal} == 0 unless on ({TRAIN}) {finished}",
        f"{max(s.stall_minutes, 10) - 5}m",
        f"Training job {WHERE} made no optimizer step for {s.stall_minutes} minutes",
        "kubetune_train_step has not moved and the run is not finished: a rank is hung in a collective "
        "(a dead peer, a network fault), in data loading, or at rendezvous.",
        f"{STATUS}, then `kubetune k8s doctor {{{{ $labels.job }}}} -n {{{{ $labels.namespace }}}}`; the "
        "training dashboard's collective p99 by rank shows a straggler. Deleting the stuck pod makes the job "
        "resume from its last checkpoint.",
        f"no optimizer step for {s.stall_minutes} min and the run is not finished",
    )


def _loss_not_finite(s: RuleSettings) -> Alert:
    # A few skipped steps are routine with fp16 loss scaling; a NaN/Inf loss gauge or a run of
    # them is not.
    signal = f"max by ({RANK}) (increase(kubetune_train_nonfinite_steps_total[10m]))"
    loss = "kubetune_train_loss"
    nan_or_inf = f"count by ({RANK}) ({loss} != {loss} or abs({loss}) == Inf)"
    return Alert(
        "KubetuneLossNotFinite",
        "critical",
        signal,
        f"{nan_or_inf} or {signal} >= 5",
        "1m",
        f"Training job {WHERE}: loss is NaN or infinite on rank {{{{ $labels.rank }}}}",
        "The loss (or gradient) of recent steps is not finite: training is diverging and checkpoints saved "
        "from now on are worthless.",
        f"{STATUS}; lower train.lr or set train.max_grad_norm, use bf16 instead of fp16, check the "
        "data for empty or huge examples; resume from the last checkpoint before the loss broke.",
        "a rank's loss is NaN/Inf for 1 min, or 5 non-finite steps in 10 min",
    )


def restarts(window: str) -> str:
    """Process restarts of each rank in `window`, counted two ways, the larger kept:
    kubetune_train_restarts_total (a worker that torchrun restarts adds 1 to the pod's
    multiprocess sum; a restarted lone process exports the resume count its checkpoint carries),
    and the resets of kubetune_train_tokens_total (a restart before the first checkpoint, which
    resumes nothing, still starts every counter from 0)."""
    resumed = f"increase(kubetune_train_restarts_total[{window}])"
    resets = f"resets(kubetune_train_tokens_total[{window}])"
    return f"({resumed} > {resets} or {resets})"


def _restarting(s: RuleSettings) -> Alert:
    signal = f"max by ({RANK}) {restarts('1h')}"
    # increase() extrapolates to the window's edges: 3 restarts may read 2.9
    return Alert(
        "KubetuneRankRestarting",
        "critical",
        signal,
        f"{signal} >= {s.restarts_per_hour - 0.5}",
        "0m",
        f"Training job {WHERE}: rank {{{{ $labels.rank }}}} restarted {s.restarts_per_hour} or more times in an hour",
        "The rank's process keeps dying and resuming from its checkpoint: each restart loses the steps since the "
        "last save and the time to reload.",
        f"`kubetune k8s logs {{{{ $labels.job }}}} -n {{{{ $labels.namespace }}}} --rank <the pod's node rank>` "
        f"shows the error, {STATUS} an OOMKilled; `kubetune k8s doctor` names the usual causes.",
        f"a rank resumed {s.restarts_per_hour} times within an hour",
    )


def _memory(s: RuleSettings) -> Alert:
    signal = f"max by ({RANK}) (kubetune_train_memory_bytes / kubetune_train_memory_budget_bytes)"
    return Alert(
        "KubetuneMemoryNearBudget",
        "warning",
        signal,
        f"{signal} > {s.memory_ratio}",
        "2m",
        f"Training job {WHERE}: rank {{{{ $labels.rank }}}} is within {round((1 - s.memory_ratio) * 100)}% of its "
        "memory budget",
        "Memory is at {{ $value | humanizePercentage }} of the budget: the memory guard will stop the run with a "
        "checkpoint, or the kernel will kill the pod.",
        "Raise k8s.resources.memory, or lower train.micro_batch_size / data.max_seq_len, or set "
        "train.gradient_checkpointing=on; then resubmit (the run resumes).",
        f"memory above {s.memory_ratio:.0%} of the budget for 2 min",
    )


def _collective(s: RuleSettings) -> Alert:
    bucket = "rate(kubetune_collective_seconds_bucket[10m])"
    # `node` kept: the runbook starts from the slow rank's node
    rank_p99 = f"histogram_quantile(0.99, sum by ({RANK}, node, op, size_bucket, le) ({bucket}))"
    job_median = f"histogram_quantile(0.5, sum by ({TRAIN}, op, size_bucket, le) ({bucket}))"
    signal = f"{rank_p99} / on ({TRAIN}, op, size_bucket) group_left {job_median}"
    return Alert(
        "KubetuneCollectiveSlow",
        "warning",
        signal,
        f"{signal} > {s.collective_factor}",
        "10m",
        f"Training job {WHERE}: {{{{ $labels.op }}}} is slow on rank {{{{ $labels.rank }}}} "
        "(node {{ $labels.node }})",
        "The rank's p99 {{ $labels.op }} latency ({{ $labels.size_bucket }} messages) is "
        '{{ $value | printf "%.1f" }} times the job\'s median: one slow link or node holds every step back.',
        "Check the node: its kubetune.io/rdma-latency-us annotation (kubetune netprobe) and its accelerator "
        "panels; `kubectl cordon` a bad node and delete the pod: the job resumes elsewhere from its checkpoint.",
        f"a rank's p99 collective latency over {s.collective_factor:g}x the job's median (same op and size) for 10 min",
    )


def _queue(s: RuleSettings) -> Alert:
    signal = f"sum by ({SERVE}) (deriv(vllm:num_requests_waiting[5m]))"
    waiting = f"sum by ({SERVE}) (vllm:num_requests_waiting)"
    return Alert(
        "KubetuneServingQueueGrowing",
        "warning",
        signal,
        f"{signal} > 0 and {waiting} > 0",
        "5m",
        "Serving {{ $labels.namespace }}/{{ $labels.model_name }}: the request queue has grown for 5 minutes",
        'Waiting requests grow by {{ $value | printf "%.2f" }} per second: the servers admit fewer requests than '
        "arrive.",
        "`kubetune k8s status <name>-serve -n {{ $labels.namespace }}`: is the autoscaler at --max-replicas, or "
        "are new pods stuck loading? Raise --max-replicas or add capacity.",
        "waiting requests grow for 5 min",
        group="serving",
    )


def _first_token(s: RuleSettings) -> Alert:
    bucket = "rate(vllm:time_to_first_token_seconds_bucket[5m])"
    signal = f"histogram_quantile(0.99, sum by ({SERVE}, le) ({bucket}))"
    return Alert(
        "KubetuneServingSlowFirstToken",
        "critical",
        signal,
        f"{signal} > {s.ttft_p99_seconds}",
        "5m",
        "Serving {{ $labels.namespace }}/{{ $labels.model_name }}: p99 time to first token above "
        f"{s.ttft_p99_seconds:g}s",
        'p99 time to first token is {{ $value | printf "%.2f" }}s (target '
        f"{s.ttft_p99_seconds:g}s): requests wait in the queue or long prompts crowd the prefill.",
        "Look at the serving dashboard's waiting requests and KV-cache use; scale out (--max-replicas) or "
        "lower --max-num-seqs / --prefill-chunk on the server.",
        f"p99 time to first token over {s.ttft_p99_seconds:g} s for 5 min",
        group="serving",
    )


def alerts(settings: RuleSettings | None = None) -> tuple[Alert, ...]:
    s = settings or RuleSettings()
    builders = (_stalled, _loss_not_finite, _restarting, _memory, _collective, _queue, _first_token)
    return tuple(build(s) for build in builders)


def rule_groups(settings: RuleSettings | None = None) -> list[KubeObject]:
    """The rule groups (`groups:` of a rule file, `spec.groups` of a PrometheusRule)."""
    groups: dict[str, list[KubeObject]] = {}
    for alert in alerts(settings):
        groups.setdefault(alert.group, []).append(alert.rule())
    return [{"name": f"kubetune-{name}", "rules": rules} for name, rules in groups.items()]


def rule_file(settings: RuleSettings | None = None) -> KubeObject:
    return {"groups": rule_groups(settings)}
