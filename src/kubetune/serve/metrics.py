"""The server's Prometheus metrics, with vLLM's names and meanings.

One dashboard, one autoscaling rule (prometheus-adapter on `vllm:num_requests_waiting`) and
the Gateway API Inference Extension's model-server protocol then work for both engines.
These names are a contract (README, "Serving metrics"): renaming one breaks users' panels.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


class ServeMetrics:
    def __init__(self, model_name: str, max_lora: int, adapter_names: list[str]) -> None:
        self.registry = CollectorRegistry()
        self.model_name, self.max_lora, self.adapter_names = model_name, max_lora, adapter_names
        label = ["model_name"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", label, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", label, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full.", label, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens read.", label, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", label, registry=r)
        self.success = Counter(
            "vllm:request_success", "Requests finished, by reason.", [*label, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", label, buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens.", label, buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, arrival to end.",
            label,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time spent waiting to be admitted.",
            label,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Adapters of running and waiting requests (value: time).",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=r,
        )
        self._lora_state: tuple[str, str] | None = None
        for gauge in (self.running, self.waiting, self.kv_usage):  # present (at 0) before the first request
            gauge.labels(model_name).set(0)
        for counter in (self.prompt_tokens, self.generation_tokens):
            counter.labels(model_name).inc(0)

    def queued(self, seconds: float) -> None:
        self.queue_time.labels(self.model_name).observe(seconds)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def finished(self, request: Any, prompt_tokens: int, generated: int, reason: str) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(generated)
        self.success.labels(name, reason).inc()
        self.e2e.labels(name).observe(time.monotonic() - request.arrival)

    def state(self, running: int, waiting: int, kv_usage: float, running_seqs: Any, waiting_seqs: Any) -> None:
        name = self.model_name
        self.running.labels(name).set(running)
        self.waiting.labels(name).set(waiting)
        self.kv_usage.labels(name).set(kv_usage)
        if self.max_lora:
            lora = (_adapters(running_seqs), _adapters(waiting_seqs))
            if lora != self._lora_state:  # one series at a time, as vLLM keeps it
                self.lora_info.clear()
                self.lora_info.labels(lora[0], lora[1], str(self.max_lora)).set(time.time())
                self._lora_state = lora


def _adapters(seqs: Any) -> str:
    return ",".join(sorted({s.request.adapter_name for s in seqs if s.request.adapter_name}))
