"""The server's Prometheus metrics: vLLM's series, built from `kubetune.contracts.metrics`.

The table of names, types, help texts, labels and buckets is its `SERVE_METRICS` (vLLM
V1's own, see there); this module only creates those objects and records into them with
vLLM's meanings (vllm/v1/metrics/stats.py), so one dashboard, one autoscaling rule and the
gateways that route on these series (KServe, llm-d, the Gateway API Inference Extension,
KEDA) work for both engines. What is recorded when:
- each engine turn: running, waiting, KV-cache usage and the adapters in use (`state`);
- each prefix-cache lookup: the prompt's tokens queried and those restored (`prefix_lookup`);
- each token: time to first token and the prompt tokens (both at the first token, when the
  prompt has been read), inter-token latency and one generation token (`first_token`, `inter_token`);
- each finished request: its finish reason and the per-request histograms (`finished`);
- each adapter stacked into or taken out of the layers: kubetune's own series (`adapter_loaded`, ...).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from kubetune.contracts.metrics import FINISH_REASONS, SERVE_ENGINE, SERVE_LABELS, SERVE_METRICS, instrument

DEFAULT_MAX_MODEL_LEN = 4096  # the engine's default context (Limits.max_model_len): the token buckets' top
_OWN = SERVE_LABELS  # a metric with just these labels is one series per server


class _Request(Protocol):
    prompt: list[int]
    arrival: float  # time.monotonic() when the server received it
    adapter_name: str | None


class _Sequence(Protocol):
    """What the metrics read of the engine's Sequence."""

    @property
    def request(self) -> _Request: ...

    started: float | None  # admitted: left the queue
    last_token: float | None
    generated: int


class ServeMetrics:
    def __init__(
        self, model_name: str, max_lora: int, adapter_names: list[str], max_model_len: int = DEFAULT_MAX_MODEL_LEN
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name, self.max_lora, self.adapter_names = model_name, max_lora, adapter_names
        families = {m.name: instrument(m, self.registry, max_model_len=max_model_len) for m in SERVE_METRICS}
        own = (model_name, SERVE_ENGINE)
        # every series exists (at 0) from the start, as vLLM creates them: a rate() or a ratio
        # has a value before the first request, and a reason that never happened reads 0, not absent
        self._m = {m.name: families[m.name].labels(*own) for m in SERVE_METRICS if m.labels == _OWN}
        success = families["vllm:request_success"]
        self._success = {reason: success.labels(*own, reason) for reason in FINISH_REASONS}
        self._lora_info = families["vllm:lora_requests_info"]
        self._lora_state: tuple[str, str] | None = None
        self._first_token: dict[int, float] = {}  # id(sequence) -> when its first token came

    def prefix_lookup(self, queried: int, hits: int) -> None:
        """A prompt of `queried` tokens looked up in the prefix cache, `hits` of them restored."""
        self._m["vllm:prefix_cache_queries"].inc(queried)
        self._m["vllm:prefix_cache_hits"].inc(hits)

    def first_token(self, seq: _Sequence, now: float) -> None:
        """The first token of `seq` came at `now`: its prompt has been read (counted now, as vLLM does)."""
        self._first_token[id(seq)] = now
        self._m["vllm:time_to_first_token_seconds"].observe(now - seq.request.arrival)
        self._m["vllm:prompt_tokens"].inc(len(seq.request.prompt))
        self._m["vllm:generation_tokens"].inc()

    def inter_token(self, seq: _Sequence, now: float) -> None:
        """A later token of `seq` came at `now` (before `seq.last_token` moves on to it)."""
        assert seq.last_token is not None
        self._m["vllm:inter_token_latency_seconds"].observe(now - seq.last_token)
        self._m["vllm:generation_tokens"].inc()

    def finished(self, seq: _Sequence, reason: str) -> None:
        """`seq` ended with `reason` (one of FINISH_REASONS)."""
        now = time.monotonic()
        first = self._first_token.pop(id(seq), None)
        self._success[reason].inc()
        self._observe("vllm:e2e_request_latency_seconds", now - seq.request.arrival)
        self._observe("vllm:request_prompt_tokens", len(seq.request.prompt))
        self._observe("vllm:request_generation_tokens", seq.generated)
        # the phases this request reached (one ended in the queue, or before its first token, has
        # no prefill, decode or inference time: vLLM never finishes such a request through its stats)
        if seq.started is None:
            return
        self._observe("vllm:request_queue_time_seconds", seq.started - seq.request.arrival)
        if first is None or seq.last_token is None:
            return
        decode = seq.last_token - first
        self._observe("vllm:request_prefill_time_seconds", first - seq.started)
        self._observe("vllm:request_decode_time_seconds", decode)
        self._observe("vllm:request_inference_time_seconds", seq.last_token - seq.started)
        # vLLM's mean time per output token: the first token is the prefill's, so it is left out
        tpot = decode / (seq.generated - 1) if seq.generated > 1 else 0.0
        self._observe("vllm:request_time_per_output_token_seconds", tpot)

    def state(self, running: int, waiting: int, kv_usage: float, running_seqs: Any, waiting_seqs: Any) -> None:
        self._m["vllm:num_requests_running"].set(running)
        self._m["vllm:num_requests_waiting"].set(waiting)
        self._m["vllm:kv_cache_usage_perc"].set(kv_usage)
        if self.max_lora:
            lora = (_adapters(running_seqs), _adapters(waiting_seqs))
            if lora != self._lora_state:
                # one series, the current one (vLLM keeps the earlier ones, with their older times;
                # readers such as the endpoint picker take the newest)
                self._lora_info.clear()
                self._lora_info.labels(str(self.max_lora), lora[1], lora[0]).set(time.time())
                self._lora_state = lora

    # --- adapters in the layers (engine.resident, --max-loras) --------------------------------
    def adapter_loaded(self, seconds: float) -> None:
        self._m["kubetune:lora_adapter_load_seconds"].observe(seconds)

    def adapter_evicted(self) -> None:
        self._m["kubetune:lora_adapter_evictions"].inc()

    def adapters_resident(self, count: int) -> None:
        self._m["kubetune:lora_adapters_resident"].set(count)

    def _observe(self, name: str, value: float) -> None:
        self._m[name].observe(value)


def _adapters(seqs: Any) -> str:
    return ",".join(sorted({s.request.adapter_name for s in seqs if s.request.adapter_name}))
