"""Prometheus metrics of a training run (`monitor.port`) and Kubeflow progress.

The names and labels are `kubetune.contracts.metrics`'s (dashboards and alerts read them).
Every rank records its own series, labelled job / rank / node. Who serves them:
- under kubetune's torchrun agent (several processes per pod), the agent gives its workers a
  fresh PROMETHEUS_MULTIPROC_DIR: each rank writes its values there (prometheus-client's
  multiprocess mode) and local rank 0 serves them all on `monitor.port`, one target per pod;
- otherwise (one process per pod, or a torchrun we did not start) each process serves its
  own on `monitor.port + local_rank`.
Recording is a few histogram observations per step: the cost is measured in BENCHMARKS.md
(monitoring on vs off in one run).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubetune.contracts.metrics import METRICS_PATH, TRAIN_METRICS, Metric, instrument, size_bucket
from kubetune.errors import UserError
from kubetune.training import memory
from kubetune.training.kubeflow_progress import KubeflowProgress

if TYPE_CHECKING:
    from kubetune.recipe import Recipe
    from kubetune.training.dist import DistEnv

log = logging.getLogger("kubetune")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True)
class Identity:
    """What the series of this process are labelled with."""

    job: str
    rank: int
    node: str

    @classmethod
    def of(cls, job: str, rank: int) -> Identity:
        # NODE_NAME: the downward API's spec.nodeName in a cluster job; the host name elsewhere
        return cls(job=job, rank=rank, node=os.environ.get("NODE_NAME") or socket.gethostname())


class TrainMetrics:
    """The contract's training metrics, with this process's labels bound."""

    def __init__(self, identity: Identity, multiprocess: bool):
        from prometheus_client import CollectorRegistry

        # multiprocess values live in files, not in a registry; a plain process serves its own
        self.registry = None if multiprocess else CollectorRegistry()
        self.server: Any = None  # the /metrics server, where this process serves
        labels = {"job": identity.job, "rank": str(identity.rank), "node": identity.node}
        self._by_name = {m.name: self._make(m, labels) for m in TRAIN_METRICS}

    def _make(self, metric: Metric, labels: dict[str, str]) -> Any:
        # mostrecent: of the multiprocess files a rank leaves (a restarted worker leaves its predecessor's
        # too), a gauge reads the newest value, not one series per process id
        m = instrument(metric, self.registry, gauge_mode="mostrecent")
        extra = [name for name in metric.labels if name not in labels]
        return m.labels(**labels) if not extra else _Partial(m, labels)

    def __getitem__(self, name: str) -> Any:
        return self._by_name[name]


class _Partial:
    """A metric with some labels bound (job/rank/node), the rest given per observation."""

    def __init__(self, metric: Any, bound: dict[str, str]):
        self.metric, self.bound = metric, bound

    def labels(self, **rest: str) -> Any:
        return self.metric.labels(**self.bound, **rest)


def serve_metrics(port: int, registry: Any) -> Any:
    """Start the /metrics server (a daemon thread); one clear line when the port is taken."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    if registry is None:
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
    try:
        server, _ = start_http_server(port, addr="0.0.0.0", registry=registry)
    except OSError as e:
        raise UserError(f"monitor.port {port}: cannot serve metrics ({e.strerror}); set another monitor.port") from e
    return server


class Telemetry:
    """One process's metrics (and rank 0's Kubeflow progress), fed by the fit loop."""

    def __init__(
        self,
        metrics: TrainMetrics | None,
        kubeflow: KubeflowProgress | None,
        total_steps: int,
        world_size: int,
        flops_per_token: float,
        peak_flops: float,
        objective_gauge: str = "kubetune_train_preference",
    ):
        self.metrics, self.kubeflow, self.objective_gauge = metrics, kubeflow, objective_gauge
        self.total_steps, self.world_size = total_steps, world_size
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self._first: tuple[int, float] | None = None  # (step, time) of this process's first step
        self._eval_loss: float | None = None
        self._last_logged: tuple[float, float] | None = None  # (epoch, loss) of the last logged step
        self._memory_read = -1.0  # time.monotonic() of the last memory reading

    def started(self, step: int, epoch: float, resumes: int) -> None:
        if self.metrics is None:
            return
        m = self.metrics
        m["kubetune_train_total_steps"].set(self.total_steps)
        m["kubetune_train_step"].set(step)
        m["kubetune_train_epoch"].set(epoch)
        m["kubetune_train_progress_ratio"].set(step / max(1, self.total_steps))
        # The run's restarts so far, counted so that increase() sees each one: a lone process
        # exports the count its checkpoint carries (the series continues across pod restarts);
        # torchrun's workers add 1 each when resumed, and multiprocess mode sums the attempts.
        multiprocess = self.metrics.registry is None
        m["kubetune_train_restarts_total"].inc(min(resumes, 1) if multiprocess else resumes)
        budget = memory.budget_bytes() or memory.limit_bytes()
        m["kubetune_train_memory_budget_bytes"].set(budget)

    def collective(self, op: str, nbytes: int, seconds: float) -> None:
        if self.metrics is None:
            return
        self.metrics["kubetune_collective_seconds"].labels(op=op, size_bucket=size_bucket(nbytes)).observe(seconds)
        self.metrics["kubetune_collective_bytes_total"].labels(op=op).inc(nbytes)

    def step(self, step: int, phases: dict[str, float], loss: float, grad_norm: float, tokens: int) -> None:
        """Every step: the step-time split and the counters (cheap)."""
        if self._first is None:
            self._first = (step - 1, time.monotonic() - sum(phases.values()))
        if self.metrics is None:
            return
        m = self.metrics
        for phase, seconds in phases.items():
            m["kubetune_train_step_seconds"].labels(phase=phase).observe(seconds)
        m["kubetune_train_tokens_total"].inc(tokens / self.world_size)  # this rank's share: ranks sum to the job
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            m["kubetune_train_nonfinite_steps_total"].inc()

    def logged(self, step: int, epoch: float, loss: float, lr: float, grad_norm: float, tokens_per_s: float) -> None:
        """Every logged step: the gauges, and Kubeflow's progress (throttled by its thread)."""
        eta = self.eta_s(step)
        self._last_logged = (epoch, loss)
        if self.metrics is not None:
            m = self.metrics
            values = {
                "kubetune_train_step": step,
                "kubetune_train_epoch": epoch,
                "kubetune_train_progress_ratio": step / max(1, self.total_steps),
                "kubetune_train_loss": loss,
                "kubetune_train_learning_rate": lr,
                "kubetune_train_grad_norm": grad_norm,
                "kubetune_train_tokens_per_second": tokens_per_s / self.world_size,
                "kubetune_train_mfu_ratio": self.mfu(tokens_per_s),
            }
            if time.monotonic() - self._memory_read >= 1.0:  # the cgroup's stats cost more than the step's metrics
                self._memory_read = time.monotonic()
                values["kubetune_train_memory_bytes"] = memory.used_bytes(1)
            if eta is not None:
                values["kubetune_train_eta_seconds"] = eta
            for name, value in values.items():
                m[name].set(value)
        if self.kubeflow is not None:
            self.kubeflow.update(100 * step / max(1, self.total_steps), eta, self._kubeflow_metrics(step, epoch, loss))

    def objective(self, values: dict[str, float]) -> None:
        """A preference or GRPO run's TRL metrics (a logged step's, an evaluation's with `eval_`)."""
        if self.metrics is None:
            return
        for name, value in values.items():
            if name not in ("loss", "eval_loss") and math.isfinite(value):
                self.metrics[self.objective_gauge].labels(metric=name).set(value)

    def evaluated(self, loss: float | None) -> None:
        if loss is None:
            return
        self._eval_loss = loss
        if self.metrics is not None:
            self.metrics["kubetune_train_eval_loss"].set(loss)

    def checkpointed(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics["kubetune_checkpoint_seconds"].observe(seconds)
            self.metrics["kubetune_checkpoint_last_timestamp_seconds"].set(time.time())

    def finished(self, step: int) -> None:
        """The final progress (100% with the eval loss after training), sent before returning."""
        if self.kubeflow is None:
            return
        if self._last_logged is not None:
            epoch, loss = self._last_logged
            self.kubeflow.update(100 * step / max(1, self.total_steps), 0, self._kubeflow_metrics(step, epoch, loss))
        self.kubeflow.close()

    def close(self) -> None:
        """Stop serving and observing (in-process callers may train again on the same port)."""
        from kubetune.training.dist import observe_collectives

        observe_collectives(None)
        if self.metrics is not None and self.metrics.server is not None:
            self.metrics.server.shutdown()
            self.metrics.server.server_close()
            self.metrics.server = None

    def eta_s(self, step: int) -> float | None:
        if self._first is None or step <= self._first[0]:
            return None
        per_step = (time.monotonic() - self._first[1]) / (step - self._first[0])
        return per_step * max(0, self.total_steps - step)

    def mfu(self, tokens_per_s: float) -> float:
        if self.peak_flops <= 0:
            return 0.0
        return tokens_per_s * self.flops_per_token / (self.peak_flops * self.world_size)

    def _kubeflow_metrics(self, step: int, epoch: float, loss: float) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {
            "loss": round(loss, 6),
            "currentStep": step,
            "totalSteps": self.total_steps,
            "currentEpoch": round(epoch, 4),
        }
        if self._eval_loss is not None:
            out["eval_loss"] = round(self._eval_loss, 6)
        return out


def metrics_port(configured: int | None, local_rank: int) -> int | None:
    """The port this process serves on (None: it does not serve; local rank 0 serves for it)."""
    if configured is None:
        return None
    if os.environ.get(MULTIPROC_ENV):
        return configured if local_rank == 0 else None
    return configured + local_rank


def multiprocess_dir_ready() -> bool:
    path = os.environ.get(MULTIPROC_ENV)
    return path is not None and Path(path).is_dir()


def open_metrics(recipe: Recipe, env: DistEnv) -> TrainMetrics | None:
    """The metrics of this process, served when it is the one that serves (first thing in set-up:
    a taken port fails in a second, not after the model has loaded)."""
    if recipe.monitor.port is None:
        return None
    job = recipe.k8s.name or Path(recipe.output_dir.rstrip("/")).name or "kubetune"
    metrics = TrainMetrics(Identity.of(job, env.rank), multiprocess=multiprocess_dir_ready())
    port = metrics_port(recipe.monitor.port, env.local_rank)
    if port is not None:
        metrics.server = serve_metrics(port, metrics.registry)
        log.info("metrics: http://%s:%d%s", socket.gethostname(), port, METRICS_PATH)
    return metrics


def start_telemetry(
    metrics: TrainMetrics | None,
    recipe: Recipe,
    env: DistEnv,
    config: Any,
    trainable: int,
    total_steps: int,
    module: Any,
) -> Telemetry:
    """The run's telemetry once the model is built: MFU's two halves, collective timing, and
    rank 0's Kubeflow progress when its contract is present."""
    import torch

    from kubetune.training.dist import observe_collectives
    from kubetune.training.flops import device_peak, flops_per_token
    from kubetune.training.parallel import time_ddp_buckets

    kubeflow = KubeflowProgress.from_env() if env.is_main and recipe.monitor.kubeflow_progress else None
    peak = 0.0
    if metrics is not None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(recipe.train.precision, torch.float32)
        peak, how = device_peak(env.device, dtype)
        log.info("metrics: MFU against %.2f TFLOP/s per device (%s)", peak / 1e12, how)
    telemetry = Telemetry(
        metrics,
        kubeflow,
        total_steps,
        env.world_size,
        flops_per_token(config, recipe.finetune.method, trainable),
        peak,
        "kubetune_train_rl" if recipe.finetune.objective == "grpo" else "kubetune_train_preference",
    )
    if metrics is not None:
        observe_collectives(telemetry.collective)
        time_ddp_buckets(module)
    return telemetry
