"""The server's vLLM metrics hold vLLM's values: per token, per request at its finish, the
prefix cache in tokens, and the finish reason vLLM would give (a stop string is "stop").

ServeMetrics is read through its real registry, as Prometheus reads it (the text exposition
parsed by prometheus_client's parser); the engine and the server are the real ones."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kubetune.contracts.engine import Limits, Request, Sampling
from kubetune.contracts.metrics import FINISH_REASONS, SERVE_METRICS, exposed_names
from kubetune.engine.core import Sequence
from kubetune.serve.native.metrics import ServeMetrics

from .conftest import metric
from .test_engine import Collector, _engine

OWN = {"model_name": "base", "engine": "0"}


def samples(metrics: ServeMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: ServeMetrics, name: str, **labels: str) -> float:
    """One sample of this server's own series (its model_name, engine "0")."""
    return metric(samples(metrics), name, model_name=metrics.model_name, engine="0", **labels)


def answered(arrived_ago: float, queued: float, prompt: int = 7) -> Sequence:
    """A sequence of a `prompt`-token request that arrived `arrived_ago` seconds before now and
    left the queue `queued` seconds later."""
    arrival = time.monotonic() - arrived_ago
    request = Request("r", list(range(prompt)), Sampling(max_tokens=16), sink=lambda _e: None, arrival=arrival)
    return Sequence(request, list(request.prompt), started=arrival + queued)


def emit(metrics: ServeMetrics, seq: Sequence, token_times: list[float]) -> None:
    """What the engine's _emit does for each token: metrics first, then the sequence moves on."""
    for t in token_times:
        now = seq.request.arrival + t
        (metrics.first_token if seq.last_token is None else metrics.inter_token)(seq, now)
        seq.generated += 1
        seq.last_token = now


def test_every_series_is_there_at_zero_before_the_first_request():
    m = ServeMetrics("base", max_lora=0, adapter_names=[])
    values = samples(m)
    for reason in FINISH_REASONS:
        assert metric(values, "vllm:request_success_total", finished_reason=reason, **OWN) == 0
    for name in ("vllm:prefix_cache_queries_total", "vllm:e2e_request_latency_seconds_count"):
        assert (name, tuple(sorted(OWN.items()))) in values
    assert {dict(ls).get("engine") for n, ls in values if n.startswith("vllm:num_requests")} == {"0"}


def test_a_request_is_measured_as_vllm_measures_it():
    """Queued 1 s, first token 3 s after arrival, then tokens every 0.5 s: vLLM's phases."""
    m = ServeMetrics("base", max_lora=0, adapter_names=[])
    seq = answered(arrived_ago=10.0, queued=1.0)
    emit(m, seq, [3.0, 3.5, 4.0, 4.5])
    assert value(m, "vllm:prompt_tokens_total") == 7  # counted at the first token: the prompt is read
    assert value(m, "vllm:generation_tokens_total") == 4
    assert value(m, "vllm:time_to_first_token_seconds_sum") == pytest.approx(3.0)
    assert value(m, "vllm:inter_token_latency_seconds_count") == 3
    assert value(m, "vllm:inter_token_latency_seconds_sum") == pytest.approx(1.5)
    assert value(m, "vllm:request_decode_time_seconds_count") == 0  # per-request: only at its finish

    m.finished(seq, "length")
    assert value(m, "vllm:request_success_total", finished_reason="length") == 1
    assert value(m, "vllm:request_success_total") == 1
    expected = {
        "vllm:request_queue_time_seconds": 1.0,
        "vllm:request_prefill_time_seconds": 2.0,  # admission to first token
        "vllm:request_decode_time_seconds": 1.5,  # first token to last
        "vllm:request_inference_time_seconds": 3.5,  # admission to last token
        "vllm:request_time_per_output_token_seconds": 0.5,  # 1.5 s over the 3 tokens after the first
        "vllm:request_prompt_tokens": 7,
        "vllm:request_generation_tokens": 4,
    }
    for name, observed in expected.items():
        assert value(m, f"{name}_count") == 1, name
        assert value(m, f"{name}_sum") == pytest.approx(observed), name
    e2e = value(m, "vllm:e2e_request_latency_seconds_sum")
    assert 10.0 <= e2e < 11.0  # arrival to now


def test_a_one_token_answer_has_no_time_per_output_token_and_a_queued_one_no_phases():
    m = ServeMetrics("base", max_lora=0, adapter_names=[])
    one = answered(arrived_ago=2.0, queued=0.5)
    emit(m, one, [1.0])
    m.finished(one, "stop")
    assert value(m, "vllm:request_time_per_output_token_seconds_count") == 1  # vLLM observes 0 here
    assert value(m, "vllm:request_time_per_output_token_seconds_sum") == 0

    gone = answered(arrived_ago=2.0, queued=0.0)
    gone.started = None  # the client left while it waited
    m.finished(gone, "abort")
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(m, "vllm:e2e_request_latency_seconds_count") == 2
    assert value(m, "vllm:request_queue_time_seconds_count") == 1  # only the one that left the queue
    assert value(m, "vllm:request_generation_tokens_sum") == 1


def test_prefix_cache_lookups_count_tokens():
    m = ServeMetrics("base", max_lora=0, adapter_names=[])
    m.prefix_lookup(42, 0)
    m.prefix_lookup(42, 32)
    assert value(m, "vllm:prefix_cache_queries_total") == 84
    assert value(m, "vllm:prefix_cache_hits_total") == 32


def test_kv_usage_running_waiting_and_adapters():
    m = ServeMetrics("base", max_lora=2, adapter_names=["a", "qv"])
    run = answered(1.0, 0.0)
    run.request.adapter_name = "qv"
    m.state(1, 2, 0.25, [run], [])
    assert value(m, "vllm:num_requests_running") == 1
    assert value(m, "vllm:num_requests_waiting") == 2
    assert value(m, "vllm:kv_cache_usage_perc") == 0.25
    lora = [dict(ls) for n, ls in samples(m) if n == "vllm:lora_requests_info"]
    assert lora == [{"max_lora": "2", "running_lora_adapters": "qv", "waiting_lora_adapters": ""}]


def test_token_histograms_have_vllms_buckets_for_the_context():
    m = ServeMetrics("base", max_lora=0, adapter_names=[], max_model_len=2048)
    bounds = sorted(
        float(dict(ls)["le"])
        for n, ls in samples(m)
        if n == "vllm:request_prompt_tokens_bucket"
        if dict(ls)["le"] != "+Inf"
    )
    assert bounds == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


def test_the_engine_counts_a_stop_as_stop_an_abort_as_abort_and_prefix_hits(tiny_runs):
    """Through the real engine: a request ended by `abort(id, "stop")` (what the server does when
    a stop string matches) is a "stop"; a client gone is an "abort"; the second of two prompts
    sharing 40 tokens hits the 32 of them in whole blocks."""
    _, engine = _engine(tiny_runs, Limits())
    m = engine.metrics
    engine.start()
    try:
        for name in ("first", "second"):
            sink = Collector()
            engine.submit(Request(name, list(range(300, 340)) + [5, 6], Sampling(4), sink))
            assert sink.done.wait(60)
        for rid, reason in (("stopped", "stop"), ("gone", "abort")):
            sink = Collector()
            engine.submit(Request(rid, [9, 10, 11], Sampling(1000), sink))
            deadline = time.monotonic() + 30
            while not sink.tokens and time.monotonic() < deadline:
                time.sleep(0.01)
            engine.abort(rid, reason)
            assert sink.done.wait(10) and sink.finish == reason
    finally:
        engine.stop()
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(m, "vllm:request_success_total", finished_reason="length") == 2
    assert value(m, "vllm:prefix_cache_queries_total") == 2 * 42 + 2 * 3
    assert value(m, "vllm:prefix_cache_hits_total") == 32


def test_the_server_counts_a_stop_string_as_stop_and_exposes_every_contract_series(tiny_server):
    base = httpx.get(f"{tiny_server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": base, "prompt": "1 2 3", "max_tokens": 16, "temperature": 0}
    whole = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert whole["finish_reason"] == "length"  # so the "stop" below is the stop string's
    text = whole["text"]
    cut = text[len(text) // 2 :][:3].strip() or text[-1]
    before = tiny_server.metrics()
    stopped = httpx.post(f"{tiny_server.url}/v1/completions", json={**body, "stop": [cut]}, timeout=60).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and cut not in stopped["choices"][0]["text"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the engine ends the sequence at its next turn
        after = tiny_server.metrics()
        if metric(after, "vllm:request_success_total") > metric(before, "vllm:request_success_total"):
            break
        time.sleep(0.05)

    def grew(reason: str) -> float:
        name = "vllm:request_success_total"
        return metric(after, name, finished_reason=reason) - metric(before, name, finished_reason=reason)

    assert (grew("stop"), grew("abort")) == (1, 0)
    exposed = {name for name, _ in after}
    for m in SERVE_METRICS:
        assert set(exposed_names(m)) <= exposed, m.name


def test_the_readme_table_is_the_contract():
    """Every serving metric of the contract is in docs/serving.md's table, with its exposed name and
    type, and the table names nothing else."""
    from tests.kit.paths import REPO

    section = (REPO / "docs" / "serving.md").read_text().split("## Serving metrics", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `((?:vllm|kubetune):[a-z0-9_]+)[^`]*` \| (\w+) \|", section, re.M))
    promised = {(exposed_names(m)[0] if m.kind == "counter" else m.name, m.kind) for m in SERVE_METRICS}
    assert rows == promised
