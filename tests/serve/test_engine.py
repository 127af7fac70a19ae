"""The native engine against transformers' own forward: continuous batching, chunked prefill,
slot moves and mixed adapters must not change a single greedy token."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from kubetune.contracts.engine import AdmissionError, Event, Limits, Request, Sampling
from kubetune.contracts.serving import Adapter
from kubetune.engine.core import MAX_FAILED_STEPS, Engine
from kubetune.engine.kvcache import SlotCache, register
from kubetune.engine.lora import install
from kubetune.serve.native.metrics import ServeMetrics
from kubetune.serve.native.models import load_served
from kubetune.serve.native.packed import pack


def _engine(tiny_runs, limits: Limits, budget: int = 64 << 20, packed: bool = False):
    a, b = tiny_runs
    served = load_served(str(a), [Adapter("qv", str(b))], torch.float32, register())
    if packed:  # every linear layer through oneDNN's packed weights
        packed_line = pack(served.lm, rows=4, only_faster=False)
        assert re.search(r"for (\d+)/\1 weight shapes", packed_line), packed_line
    cache = SlotCache.for_config(served.lm.config, torch.float32, budget)
    metrics = ServeMetrics(served.base_name, 2, served.adapter_names)
    return served, Engine(served.lm, served.tokenizer.eos_token_id, cache, served.lora, limits, metrics)


class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.done = threading.Event()

    def __call__(self, ev: Event) -> None:
        if ev.token is not None:
            self.tokens.append(ev.token)
        if ev.finish_reason:
            self.finish = ev.finish_reason
            self.done.set()


def _reference_models(tiny_runs, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from kubetune.models.runs import load_run

    a, b = tiny_runs
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return {
        -1: base,
        0: load_run(a, dtype=torch.float32)[0].eval(),
        1: load_run(b, dtype=torch.float32)[0].eval(),
    }


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_batched_chunked_mixed_adapters_match_transformers(tiny_runs, tiny_model_dir, packed):
    """Nine sequences of different lengths, three adapters (base, a, qv), prompts read in chunks
    of 5 tokens, sequences finishing at different steps (so slots move): every generated token
    is the argmax of transformers' full forward of the same model and adapter."""
    _served, engine = _engine(tiny_runs, Limits(max_num_seqs=6, prefill_chunk=5), packed=packed)
    refs = _reference_models(tiny_runs, tiny_model_dir)
    torch.manual_seed(1)
    jobs = []
    for i in range(9):
        prompt = torch.randint(10, 2000, (3 + 2 * i,)).tolist()
        sink = Collector()
        adapter = (i % 3) - 1
        engine.submit(Request(f"r{i}", prompt, Sampling(max_tokens=4 + (i * 5) % 11), sink, adapter))
        jobs.append((prompt, adapter, sink))
    engine.start()
    try:
        for _, _, sink in jobs:
            assert sink.done.wait(120)
    finally:
        engine.stop()
    distinct = set()
    for prompt, adapter, sink in jobs:
        assert sink.finish in ("length", "stop") and sink.tokens
        with torch.no_grad():
            logits = refs[adapter](torch.tensor([prompt + sink.tokens])).logits[0]
        for step, token in enumerate(sink.tokens):
            row = logits[len(prompt) - 1 + step]
            assert row[token] >= row.max() - 1e-4, f"adapter {adapter}, step {step}: not the greedy token"
        distinct.add((tuple(prompt), adapter, tuple(sink.tokens)))
    # the adapters really differ from the base on the same prompt
    with torch.no_grad():
        x = torch.tensor([jobs[0][0]])
        assert not torch.allclose(refs[-1](x).logits, refs[0](x).logits, atol=1e-3)
        assert not torch.allclose(refs[-1](x).logits, refs[1](x).logits, atol=1e-3)
    assert engine.cache.slots <= 6


def test_sampling_with_a_seed_repeats(tiny_runs):
    _, engine = _engine(tiny_runs, Limits())
    engine.start()
    try:
        outs = []
        for seed in (7, 7, 8):
            sink = Collector()
            engine.submit(Request(f"s{seed}{len(outs)}", [11, 12, 13], Sampling(12, 1.0, 0.9, seed), sink))
            assert sink.done.wait(60)
            outs.append(sink.tokens)
    finally:
        engine.stop()
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_admission_limits_name_the_option(tiny_runs):
    _, engine = _engine(tiny_runs, Limits(max_waiting=2, max_model_len=64, max_prompt_tokens=40), budget=1 << 20)
    with pytest.raises(AdmissionError) as e:
        engine.submit(Request("long", [5] * 41, Sampling(4), Collector()))
    assert e.value.status == 400 and "--max-prompt-tokens" in e.value.message
    with pytest.raises(AdmissionError) as e:
        engine.submit(Request("ctx", [5] * 30, Sampling(40), Collector()))
    assert e.value.status == 400 and "--max-model-len" in e.value.message
    for i in range(2):  # the loop is not running: requests stay queued
        engine.submit(Request(f"q{i}", [5, 6], Sampling(4), Collector()))
    with pytest.raises(AdmissionError) as e:
        engine.submit(Request("full", [5, 6], Sampling(4), Collector()))
    assert e.value.status == 429 and "--max-waiting" in e.value.message


def test_kv_budget_limits_the_batch_and_never_a_request_that_fits(tiny_runs):
    """A budget for two sequences: the third waits for a slot instead of overrunning memory."""
    _served, engine = _engine(tiny_runs, Limits(prefill_chunk=64))
    per_token = engine.cache.token_bytes
    engine.cache.budget_tokens = 2 * 256  # room for two sequences of up to 256 positions
    sinks = [Collector() for _ in range(3)]
    for i, sink in enumerate(sinks):
        engine.submit(Request(f"k{i}", [7] * 20, Sampling(30), sink))
    engine.start()
    try:
        assert all(s.done.wait(60) for s in sinks)
    finally:
        engine.stop()
    assert engine.cache.allocated_bytes <= 2 * 256 * per_token
    assert all(s.finish in ("length", "stop") for s in sinks)


def test_the_cache_grows_only_when_its_slots_or_positions_run_out():
    """Growing copies the whole cache (seconds for 64 slots): one sequence at a time never
    grows it past one slot, more sequences double the slots, a longer one rounds its
    positions up, and the budget caps both."""
    cache = SlotCache(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32, budget_bytes=2 * 2 * 4 * 4 * 4096)
    for _ in range(5):  # five requests one after the other
        cache.reserve(1, 100, max_slots=64)
    assert (cache.slots, cache.capacity) == (1, 256)
    cache.reserve(3, 100, max_slots=64)
    assert cache.slots == 3  # need beyond double: exactly what is needed
    cache.reserve(4, 100, max_slots=64)
    assert cache.slots == 6  # doubled
    cache.reserve(2, 300, max_slots=64)
    assert (cache.slots, cache.capacity) == (6, 512)
    assert len(cache.k) == 2 and cache.k[0].shape == (6, 1, 512, 4)
    assert not cache.fits(9, 512)  # 9 x 512 > the 4,096-token budget


def test_the_cache_takes_head_dim_from_a_config_that_sets_it(tmp_path):
    """Some models' heads are not hidden_size / num_attention_heads wide (Qwen3, Gemma): the
    cache built from such a config holds their width, and the engine answers as transformers."""
    from transformers import AutoModelForCausalLM

    from tests.kit.models import tiny_model

    reference = tiny_model(vocab_size=256, head_dim=16, tie_word_embeddings=False).eval()
    cfg = reference.config
    reference.save_pretrained(tmp_path)
    lm = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation=register()).eval()
    cache = SlotCache.for_config(lm.config, torch.float32, 16 << 20)
    assert cache.head_dim == 16 != cfg.hidden_size // cfg.num_attention_heads
    engine = Engine(lm, None, cache, install(lm, []), Limits(), ServeMetrics("base", 0, []))
    prompt, sink = [5, 17, 42, 99, 3], Collector()
    engine.submit(Request("r", prompt, Sampling(max_tokens=6), sink))
    engine.start()
    try:
        assert sink.done.wait(60)
    finally:
        engine.stop()
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + sink.tokens])).logits[0]
    for step, token in enumerate(sink.tokens):
        row = logits[len(prompt) - 1 + step]
        assert row[token] >= row.max() - 1e-4, f"step {step}: not the greedy token"


def test_abort_leaves_the_batch_at_the_next_step(tiny_runs):
    _, engine = _engine(tiny_runs, Limits())
    first = threading.Event()
    sink = Collector()

    def on_event(ev: Event) -> None:
        sink(ev)
        first.set()

    engine.start()
    try:
        engine.submit(Request("long", [9, 10, 11], Sampling(1000), on_event))
        assert first.wait(30)
        engine.abort("long")
        assert sink.done.wait(10)
    finally:
        engine.stop()
    assert sink.finish == "abort" and len(sink.tokens) < 1000
    assert engine._slots == [] and engine.in_flight == 0


def test_prompt_prefixes_are_reused_per_adapter_with_the_same_tokens(tiny_runs):
    """The second request with the same 40-token prefix reads 32 of them from the prefix cache
    (two blocks of 16; never the last prompt token) and answers exactly as the first; the same
    prompt for another adapter reuses nothing (its K/V differ)."""
    _, engine = _engine(tiny_runs, Limits())
    engine.start()
    try:
        answers = []
        for adapter in (0, 0, 1):
            sink = Collector()
            engine.submit(Request(f"p{len(answers)}", list(range(300, 340)) + [5, 6], Sampling(8), sink, adapter))
            assert sink.done.wait(60)
            answers.append((engine.prefixes.hits, sink.tokens))
    finally:
        engine.stop()
    assert [hits for hits, _ in answers] == [0, 32, 32]
    assert answers[0][1] == answers[1][1]


@pytest.mark.parametrize("prefill_chunk", [512, 20])
def test_a_burst_reuses_the_prefix_the_first_prompt_wrote(tiny_runs, prefill_chunk):
    """Requests admitted together take their prefix when their first chunk is read, and wait
    while another chunk of the same turn writes it: whether the whole burst fits one turn
    (512) or the first prompt is read over three (20), the first prompt reads its 32-token
    prefix and the other two reuse it (they all answer alike, as the same prompt must)."""
    _, engine = _engine(tiny_runs, Limits(prefill_chunk=prefill_chunk))
    sinks = [Collector() for _ in range(3)]
    for i, sink in enumerate(sinks):
        engine.submit(Request(f"b{i}", list(range(300, 340)) + [5, 6], Sampling(6), sink, 0))
    engine.start()
    try:
        assert all(sink.done.wait(60) for sink in sinks)
    finally:
        engine.stop()
    assert engine.prefixes.hits == 64
    assert sinks[0].tokens == sinks[1].tokens == sinks[2].tokens


def test_run_serves_on_the_calling_thread_until_stopped(tiny_runs):
    """The server runs the loop on the thread that loaded the model (Engine.run), so that
    torch keeps one OpenMP pool; stop() from another thread ends it."""
    _, engine = _engine(tiny_runs, Limits())
    seen: list[threading.Thread] = []

    def serve() -> None:
        seen.append(threading.current_thread())
        engine.run()

    thread = threading.Thread(target=serve)
    thread.start()
    sink = Collector()
    engine.submit(Request("t", [11, 12, 13], Sampling(3), sink))
    assert sink.done.wait(60) and len(sink.tokens) == 3
    engine.stop()
    thread.join(10)
    assert not thread.is_alive() and seen == [thread]


def test_fused_projections_equal_the_separate_layers(tiny_runs):
    """q/k/v and gate/up run as one GEMM each (with the adapters' blocks), and give the same
    logits as the model with one layer per projection, for base and adapter tokens in one batch."""
    from kubetune.engine.lora import FusedLinear, Member

    a, b = tiny_runs
    outs = []
    ids = torch.randint(10, 2000, (1, 6))
    for fuse in (True, False):
        served = load_served(str(a), [Adapter("qv", str(b))], torch.float32, "eager", fuse=fuse)
        attn = served.lm.model.layers[0].self_attn
        assert isinstance(attn.q_proj, Member) is fuse and isinstance(attn.v_proj, Member) is fuse
        assert isinstance(served.lm.model.layers[0].mlp.up_proj, Member) is fuse
        assert isinstance(attn.o_proj, FusedLinear)  # alone, but it holds run a's adapter
        served.lora.set([-1, 0, 1, 1, 0, -1])
        with torch.no_grad():
            outs.append(served.lm(input_ids=ids).logits)
        served.lora.set([-1] * 6)
        with torch.no_grad():
            outs.append(served.lm(input_ids=ids).logits)
    torch.testing.assert_close(outs[0], outs[2], atol=1e-5, rtol=1e-5)  # mixed adapters
    torch.testing.assert_close(outs[1], outs[3], atol=1e-5, rtol=1e-5)  # base only
    assert not torch.allclose(outs[0], outs[1], atol=1e-4)  # the adapters did change the logits


def test_one_request_whose_sampling_fails_ends_alone(tiny_runs, monkeypatch):
    from kubetune.engine import sampling as sampling_module

    _, engine = _engine(tiny_runs, Limits())
    real = sampling_module.sample_row

    def fails_for_seed_13(logits, sampling, generator):
        if sampling.seed == 13:
            raise RuntimeError("invalid multinomial distribution")
        return real(logits, sampling, generator)

    monkeypatch.setattr(sampling_module, "sample_row", fails_for_seed_13)
    engine.start()
    try:
        bad, good, greedy = Collector(), Collector(), Collector()
        engine.submit(Request("bad", [11, 12, 13], Sampling(8, 1.0, 1.0, 13), bad))
        engine.submit(Request("good", [11, 12, 13], Sampling(8, 1.0, 1.0, 14), good))
        engine.submit(Request("tiny-t", [11, 12, 13], Sampling(8, 1e-39, 1.0, 15), greedy))  # 1/t overflows
        for sink in (bad, good, greedy):
            assert sink.done.wait(60)
        assert bad.finish == "error" and good.finish == "length" and greedy.finish == "length"
        assert engine.error is None and len(good.tokens) == 8
    finally:
        engine.stop()


def test_a_broken_forward_fails_its_requests_then_the_engine_says_so(tiny_runs, monkeypatch):
    _, engine = _engine(tiny_runs, Limits())
    monkeypatch.setattr(engine, "_forward", lambda *a: (_ for _ in ()).throw(RuntimeError("broken kernel")))
    engine.start()
    sinks = [Collector() for _ in range(MAX_FAILED_STEPS)]
    try:
        for i, sink in enumerate(sinks):
            engine.submit(Request(f"r{i}", [11, 12, 13], Sampling(4), sink))
            assert sink.done.wait(60) and sink.finish == "error"
        deadline = time.monotonic() + 30
        while engine.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.error is not None and engine.in_flight == 0
        with pytest.raises(AdmissionError) as e:
            engine.submit(Request("late", [11], Sampling(4), Collector()))
        assert e.value.status == 503
    finally:
        engine.stop()
