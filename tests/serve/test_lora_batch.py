"""An adapter request's answer must not depend on the batch it is served in (issue 24): its
logits in any mix of base and adapter requests, decode and prefill, equal it served alone
within the dtype's tolerance, and its greedy text is the same. Adapters loaded while serving
must answer as the same adapter declared at start."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kubetune.contracts.engine import Limits, Request, Sampling
from kubetune.engine.core import Engine
from kubetune.engine.kvcache import Batch, SlotCache, register
from kubetune.engine.lora import BASE, add_late_adapter, install, read_adapter_files, read_adapters
from kubetune.serve.native.metrics import ServeMetrics

# (rank, targets) of the test's adapters: every linear layer, two of the attention's, an MLP's and o_proj
ADAPTERS = [(8, "all-linear"), (16, ["q_proj", "v_proj"]), (4, ["gate_proj", "down_proj", "o_proj"])]
B_STD = 0.3  # larger than training's zero start, so that each adapter moves the logits a lot


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_model_dir) -> list[tuple[str, str]]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("random-adapters")
    torch.manual_seed(3)
    found = []
    for i, (r, targets) in enumerate(ADAPTERS):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=B_STD)
        model.save_pretrained(root / f"ad{i}")
        found.append((f"ad{i}", str(root / f"ad{i}")))
    return found


def _engine(model_dir: Path, dirs: list[tuple[str, str]], dtype: torch.dtype, late: list[tuple[str, str]] = ()):
    """The engine over the tiny Llama with `dirs` declared at start and `late` loaded after."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=register()).eval()
    lora = install(lm, read_adapters(lm, dirs))
    for i, (name, path) in enumerate(late):
        add_late_adapter(lm, lora, read_adapter_files(name, path), len(dirs) + i)
    cache = SlotCache.for_config(lm.config, dtype, 64 << 20)
    cache.reserve(16, 256)
    metrics = ServeMetrics("base", len(dirs) + len(late), [n for n, _ in [*dirs, *late]])
    return Engine(lm, None, cache, lora, Limits(prefill_chunk=16), metrics)


PROMPT = list(range(40, 64))
FORCED = [70, 71, 72, 73, 74, 75]  # the request's next tokens, fed back whatever it predicts


@torch.inference_mode()
def _logits(engine: Engine, adapter: int, slot: int, others: list[int], prefill_others: list[int]) -> torch.Tensor:
    """[1 + len(FORCED), vocab]: the request's logits after its prompt, then at each decode step,
    in a forward with `others` (one adapter index per other decoding sequence; the request
    decodes in `slot` among them) and the prompt chunks of `prefill_others` beside it."""
    gen = torch.Generator().manual_seed(11)

    def other_ids(n: int) -> list[int]:
        return torch.randint(5, 200, (n,), generator=gen).tolist()

    def run(ids: list[int], decode: list[int], chunks: list[tuple[int, int, int]], adapters: list[int], row: int):
        for j, a in enumerate(prefill_others):  # other prompts being read in the same forward
            ids, adapters = ids + other_ids(5 + 2 * j), adapters + [a] * (5 + 2 * j)
            chunks = [*chunks, (15 - j, 0, 5 + 2 * j)]
        hidden = engine._forward(torch.tensor(ids), Batch.of(decode, chunks), adapters)
        return engine.head(hidden[row : row + 1]).float()

    rows = [run(list(PROMPT), [], [(slot, 0, len(PROMPT))], [adapter] * len(PROMPT), len(PROMPT) - 1)]
    mix = list(others)
    mix.insert(slot, adapter)
    for step, token in enumerate(FORCED):
        ids = [token if k == slot else other_ids(1)[0] for k in range(len(mix))]
        rows.append(run(ids, [len(PROMPT) + step] * len(mix), [], list(mix), slot))
    return torch.cat(rows)


MIXES = {  # name: (the request's slot, other decoding sequences' adapters, other prompts' adapters)
    "three base": (1, [BASE, BASE, BASE], []),
    "the same adapter": (2, ["self", "self"], []),
    "every adapter": (0, [1, 2, BASE, 1, 2, BASE, 1], []),
    "decode and prefill": (3, [BASE, 1, 2], [BASE, 1]),
    "twelve mixed": (5, [BASE, 1, 2, 0] * 3, [2]),
}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4 * 2**-8}  # of the logits' scale: fp32 noise, 4 bf16 ulps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adapter_logits_do_not_depend_on_the_batch(tiny_model_dir, adapter_dirs, dtype):
    engine = _engine(tiny_model_dir, adapter_dirs, dtype)
    alone = {a: _logits(engine, a, 0, [], []) for a in (BASE, 0, 1, 2)}
    scale = max(float(v.abs().max()) for v in alone.values())
    tolerance = TOLERANCE[dtype] * max(1.0, scale)
    for adapter in (0, 1, 2):  # each adapter really changes the answer, far beyond the tolerance
        assert float((alone[adapter] - alone[BASE]).abs().max()) > 20 * tolerance
    for adapter in (BASE, 0, 1, 2):
        for name, (slot, others, prefill) in MIXES.items():
            others = [adapter if o == "self" else o for o in others]
            mixed = _logits(engine, adapter, slot, others, prefill)
            drift = float((mixed - alone[adapter]).abs().max())
            assert drift <= tolerance, f"adapter {adapter} with {name}: logits moved {drift:.3g} (> {tolerance:.3g})"


class _Tokens:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.done = threading.Event()

    def __call__(self, event) -> None:
        if event.token is not None:
            self.tokens.append(event.token)
        if event.finish_reason:
            self.done.set()


def _serve(engine: Engine, jobs: list[tuple[list[int], int]], max_tokens: int = 12) -> list[list[int]]:
    sinks = [_Tokens() for _ in jobs]
    for i, ((prompt, adapter), sink) in enumerate(zip(jobs, sinks)):
        engine.submit(Request(f"j{i}-{id(sink)}", prompt, Sampling(max_tokens), sink, adapter))
    for sink in sinks:
        assert sink.done.wait(120)
    return [s.tokens for s in sinks]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_text_alone_equals_batched_with_base_and_other_adapters(tiny_model_dir, adapter_dirs, dtype):
    """Eight requests (base and three adapters, prompts of different lengths read in chunks of
    16 beside the decoding ones): each one's greedy tokens are those it gets alone."""
    engine = _engine(tiny_model_dir, adapter_dirs, dtype)
    engine.start()
    try:
        jobs = [(list(range(30 + 7 * i, 45 + 11 * i)), (BASE, 0, 1, 2)[i % 4]) for i in range(8)]
        alone = [_serve(engine, [job])[0] for job in jobs]
        together = _serve(engine, jobs)
        backwards = _serve(engine, jobs[::-1])[::-1]
    finally:
        engine.stop()
    assert len({tuple(t) for t in alone}) > 4  # the adapters answer differently
    assert together == alone
    assert backwards == alone


@pytest.mark.parametrize(
    ("declared", "late"),
    [([1], [2]), ([2], [0, 1])],
    ids=["new layers wrapped", "beside fused and single joint weights"],
)
def test_an_adapter_loaded_while_serving_answers_as_one_declared_at_start(tiny_model_dir, adapter_dirs, declared, late):
    """The same adapters all declared at start, against some declared and the rest loaded
    later: beside the joint weights (q/k/v and gate/up members, single layers), or wrapping
    o_proj and down_proj where no declared adapter targets them."""
    everything = _engine(tiny_model_dir, [adapter_dirs[i] for i in declared + late], torch.float32)
    loaded = _engine(
        tiny_model_dir, [adapter_dirs[i] for i in declared], torch.float32, late=[adapter_dirs[i] for i in late]
    )
    count = len(declared) + len(late)
    for adapter in (BASE, *range(count)):
        for slot, others, prefill in MIXES.values():
            others = [adapter if o == "self" else o if o == BASE else o % count for o in others]
            prefill = [p if p == BASE else p % count for p in prefill]
            a = _logits(everything, adapter, slot, others, prefill)
            b = _logits(loaded, adapter, slot, others, prefill)
            assert torch.allclose(a, b, atol=1e-4, rtol=0), f"adapter {adapter}: {(a - b).abs().max():.3g}"


def test_reading_an_adapters_files_equals_reading_it_through_peft(tiny_model_dir, adapter_dirs, tiny_runs):
    from transformers import AutoModelForCausalLM

    from kubetune.rundir import RunDir

    run_b = RunDir(tiny_runs[1])
    dirs = [*adapter_dirs, ("run-b", str(run_b.finished_weights(run_b.recipe())))]
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for through_peft, (name, path) in zip(read_adapters(lm, dirs), dirs):
        from_files = read_adapter_files(name, path)
        assert from_files.rank == through_peft.rank and from_files.layers.keys() == through_peft.layers.keys()
        for key, (a, b, scaling) in through_peft.layers.items():
            fa, fb, fs = from_files.layers[key]
            assert torch.equal(fa, a) and torch.equal(fb, b) and fs == scaling
