"""`--max-loras` inside the engine: which adapter leaves the layers (the least recently used one no
running sequence uses), when a sequence must wait, and that an evicted adapter reloads to the same
greedy tokens; in process, over the tiny Llama's two LoRA runs and a third adapter read from files."""

from __future__ import annotations

import threading

import torch

from kubetune.contracts.engine import Event, Limits, Request, Sampling
from kubetune.contracts.serving import Adapter
from kubetune.engine.core import Engine
from kubetune.engine.kvcache import SlotCache, register
from kubetune.engine.lora import read_adapter_files
from kubetune.rundir import RunDir
from kubetune.serve.native.metrics import ServeMetrics
from kubetune.serve.native.models import load_served


def _served(tiny_runs, max_loras: int):
    a, b = tiny_runs
    served = load_served(str(a), [Adapter("qv", str(b))], torch.float32, register(), max_loras=max_loras)
    third = read_adapter_files("third", str(RunDir(b).finished_weights(RunDir(b).recipe())))
    served.resident.register(2, third)  # as a runtime load does, under index 2
    return served


def test_the_least_recently_used_idle_adapter_leaves(tiny_runs):
    resident = _served(tiny_runs, max_loras=2).resident
    assert list(resident.resident) == [0, 1] and set(resident.known) == {0, 1, 2}  # registered: room for two
    assert resident.ensure(2, busy={0})  # 0 runs: 1 goes, though 0 was loaded first
    assert list(resident.resident) == [0, 2]
    assert not resident.ensure(1, busy={0, 2})  # both slots run a sequence: it waits
    assert resident.ensure(0, busy=set()) and list(resident.resident) == [2, 0]  # used: now the most recent
    assert resident.ensure(1, busy=set()) and list(resident.resident) == [0, 1]
    assert resident.ensure(-1, busy={0, 1})  # the base needs no slot
    resident.retire(0)
    resident.sweep(in_use={0})  # a request still uses it: it stays
    assert 0 in resident.known and 0 in resident.resident
    resident.sweep(in_use=set())
    assert 0 not in resident.known and list(resident.resident) == [1]


def _greedy(engine: Engine, adapter: int, name: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    done = threading.Event()

    def sink(event: Event) -> None:
        if event.token is not None:
            tokens.append(event.token)
        else:
            done.set()

    engine.submit(Request(f"r-{len(prompt)}-{adapter}", prompt, Sampling(8), sink, adapter, name))
    assert done.wait(60)
    return tokens


def test_one_slot_three_adapters_each_answers_as_with_a_slot_each(tiny_runs):
    answers = []
    for max_loras in (3, 1):
        served = _served(tiny_runs, max_loras)
        cache = SlotCache.for_config(served.lm.config, torch.float32, 64 << 20)
        metrics = ServeMetrics(served.base_name, max_loras, served.adapter_names)
        served.resident.metrics = metrics
        eos = served.tokenizer.eos_token_id
        engine = Engine(served.lm, eos, cache, served.lora, Limits(), metrics, served.resident)
        engine.start()
        try:
            prompt = served.tokenizer("What is 3 plus 3?")["input_ids"]
            names = ("run-a", "qv", "third")
            answers.append([_greedy(engine, i % 3, names[i % 3], prompt) for i in range(6)])
        finally:
            engine.stop()
        assert len(served.resident.resident) == min(max_loras, 3)
    assert answers[0] == answers[1]
    assert answers[0][0] != answers[0][1]  # different adapters, different answers
