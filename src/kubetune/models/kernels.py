"""Kernel choices by measurement, not by the CPU a developer happened to have.

Which compute precision and which attention kernel are fastest depends on the machine:
bf16 matmuls run on AMX tiles on a 4th-generation Xeon, on AVX-512-BF16 on a Zen 4 EPYC,
and, on a CPU with neither, through a conversion path that is several to many times slower
than fp32. So where the recipe says `auto`, the model's own shapes are timed at start-up
by the fair rules of `kubetune.models.measure` (warm-up, interleaved rounds, medians, more
rounds where the evidence is unclear or contradicts the CPU's bf16 flags), the decision is
cached per CPU model, ISA, torch version, thread count and shapes, confirmed by a short
round at every later start, and logged in one line:

    kernels: precision=fp32, attention=fp32 (fp32 10.9 ms [10.7-11.2] vs bf16 27.1 ms [...] per matmul pair, 7 rounds)

Where `model.packed_attention` is `auto`, one more question is timed on the data's first
packed row: whether its samples' attention runs faster on flash or on the grouped kernel
(the scores as matmuls, kubetune.models.attention); "grouped attention up to N tokens" in the
kernels line means samples of at most N tokens take the grouped one.

Training, `kubetune eval`, `kubetune generate` and `kubetune serve --dtype auto` all take
their precision from `choose` here: one rule for one fact.

Accelerators are not probed: CUDA and Gaudi run bf16 natively (fp16 on CUDA devices
without bf16), and their attention runs in the compute dtype (on Gaudi through Habana's
FusedSDPA, kubetune.models.attention).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kubetune.models import measure
from kubetune.models.attention import GROUPED_BLOCK, GROUPED_MAX_TOKENS
from kubetune.models.decoding import AutocastFactory
from kubetune.models.measure import Clock, Decision, Question, Workload

log = logging.getLogger("kubetune")

PROBE_ROWS = 256  # tokens per probe matmul: large enough to reach the kernel's steady speed
BF16_MARGIN = 0.9  # bf16 changes the numerics: choose it only when clearly faster (<= 90% of fp32)
GROUPED_MARGIN = 0.95  # the grouped kernel keeps more memory: choose it only when it is faster by this
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # the CPU units that make bf16 matmuls fast
FP16_FLAGS = ("amx_fp16", "avx512_fp16")  # and fp16 ones


@dataclass(frozen=True)
class ModelShapes:
    """The shapes a probe runs on: the model's projections and one packed row's samples."""

    hidden: int
    intermediate: int
    heads: int
    head_dim: int
    sample_lengths: tuple[int, ...] = ()
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as query heads

    @classmethod
    def of(cls, config: Any, sample_lengths: list[int] | tuple[int, ...] = ()) -> ModelShapes:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.hidden_size, config.intermediate_size, heads, head_dim, tuple(sample_lengths), kv)

    def grouped_lengths(self) -> tuple[int, ...]:
        """The probe row's samples the grouped attention kernel may take."""
        return tuple(n for n in self.sample_lengths if n <= GROUPED_MAX_TOKENS)


@dataclass(frozen=True)
class KernelPlan:
    precision: str  # bf16 | fp16 | fp32: the autocast dtype of the compute
    attention: str  # fp32 (samples upcast to fp32 for the flash kernel) | native (the compute dtype)
    evidence: tuple[str, ...] = ()  # one phrase per measured choice
    cached: bool = False  # every measured choice came from the cache (confirmed at this start)
    grouped_up_to: int = 0  # samples this short take the grouped attention kernel (0: none)

    def describe(self) -> str:
        why = f" ({'; '.join(self.evidence)})" if self.evidence else ""
        grouped = f", grouped attention up to {self.grouped_up_to} tokens" if self.grouped_up_to else ""
        return f"kernels: precision={self.precision}, attention={self.attention}{grouped}{why}"


def choose(
    precision: str,
    attention: str,
    shapes: ModelShapes,
    device: torch.device,
    clock: Clock | None = None,
    remeasure: bool = False,
) -> KernelPlan:
    """Resolve `auto` choices: measured (or cached and confirmed) on CPU, known facts elsewhere."""
    if device.type != "cpu":
        return _accelerator_plan(precision, attention, device)
    decisions: list[Decision] = []
    measure_attention = attention == "auto"
    warning = None if precision == "auto" else slow_half_warning(precision)
    if precision == "auto":
        decisions.append(_settle(precision_question(shapes), lambda: matmul_workloads(shapes), clock, remeasure))
        precision = decisions[-1].choice
    if precision == "fp32":
        attention = "fp32"  # the upcast-or-not question exists only in half precision
    elif attention == "auto":
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        q = attention_question(shapes, dtype)
        decisions.append(_settle(q, lambda: attention_workloads(shapes, dtype), clock, remeasure))
        attention = decisions[-1].choice
    grouped_up_to = 0
    if measure_attention and shapes.grouped_lengths():
        dtype = attention_dtype(precision, attention)
        q = grouped_question(shapes, dtype)
        decisions.append(_settle(q, lambda: grouped_workloads(shapes, dtype), clock, remeasure))
        grouped_up_to = GROUPED_MAX_TOKENS if decisions[-1].choice == "grouped" else 0
    return _plan(precision, attention, decisions, warning, grouped_up_to)


def attention_dtype(precision: str, attention: str) -> torch.dtype:
    """The dtype per-sample attention computes in."""
    if attention == "fp32" or precision == "fp32":
        return torch.float32
    return torch.float16 if precision == "fp16" else torch.bfloat16


def slow_half_warning(precision: str) -> str | None:
    """The phrase for a half precision set by hand on a CPU without its units, where its
    matmuls take a conversion path many times slower than fp32 (None where it has them)."""
    flags = {"bf16": BF16_FLAGS, "fp16": FP16_FLAGS}.get(precision)
    if flags is None or _cpu_has_any(flags):
        return None
    return f"{precision} as set, on a CPU without {' or '.join(flags)}: slow here; precision=auto measures"


def autocast_context(precision: str, device: torch.device) -> AutocastFactory:
    """The autocast a precision computes under (none for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype)


def compute_precision(precision: str, config: Any, device: torch.device) -> str:
    """The precision of a process that only runs the model (eval, generate, serve): the
    same decision as training's, on the model's projection shapes."""
    return choose(precision, "fp32", ModelShapes.of(config), device).precision


def _settle(q: Question, build: Any, clock: Clock | None, remeasure: bool) -> Decision:
    kw = {"clock": clock} if clock is not None else {}
    return measure.settle(q, build, remeasure=remeasure, **kw)


def _plan(
    precision: str, attention: str, decisions: list[Decision], warning: str | None = None, grouped_up_to: int = 0
) -> KernelPlan:
    evidence = (*((warning,) if warning else ()), *(f"{d.question}: {d.describe()}" for d in decisions))
    cached = bool(decisions) and all(d.cached for d in decisions)
    return KernelPlan(precision, attention, evidence, cached, grouped_up_to)


def _accelerator_plan(precision: str, attention: str, device: torch.device) -> KernelPlan:
    if precision == "auto":
        bf16 = device.type != "cuda" or torch.cuda.is_bf16_supported()
        precision = "bf16" if bf16 else "fp16"
    return KernelPlan(precision, "native" if attention == "auto" else attention)


# --- the questions ----------------------------------------------------------------------


def cpu_has_bf16_units() -> bool:
    """AMX or AVX-512-BF16: the flags that predict fast bf16 matmuls (timing decides)."""
    return _cpu_has_any(BF16_FLAGS)


def _cpu_has_any(flags: tuple[str, ...]) -> bool:
    return any(f in measure.cpu_flags() for f in flags)


def precision_question(shapes: ModelShapes) -> Question:
    return Question(
        name="precision",
        default="fp32",
        challenger="bf16",
        margin=BF16_MARGIN,
        key={
            "threads": torch.get_num_threads(),
            "rows": PROBE_ROWS,
            "hidden": shapes.hidden,
            "intermediate": shapes.intermediate,
        },
        prior="bf16" if cpu_has_bf16_units() else "fp32",
        unit="per matmul pair",
    )


def attention_question(shapes: ModelShapes, dtype: torch.dtype) -> Question:
    return Question(
        name="attention",
        default="fp32",
        challenger="native",
        margin=1.0,
        key={
            "threads": torch.get_num_threads(),
            "heads": shapes.heads,
            "head_dim": shapes.head_dim,
            "samples": list(shapes.sample_lengths or (PROBE_ROWS,)),
            "dtype": str(dtype),
        },
        unit="per layer",
    )


def grouped_question(shapes: ModelShapes, dtype: torch.dtype) -> Question:
    """Per-sample attention: flash, or the scores as grouped matmuls, which keep the
    probabilities for backward: it must win by a margin to pay for them."""
    return Question(
        name="grouped_attention",
        default="flash",
        challenger="grouped",
        margin=GROUPED_MARGIN,
        key={
            "threads": torch.get_num_threads(),
            "heads": shapes.heads,
            "kv_heads": shapes.kv_heads or shapes.heads,
            "head_dim": shapes.head_dim,
            "samples": list(shapes.grouped_lengths()),
            "dtype": str(dtype),
            "block": GROUPED_BLOCK,  # the kernel's tile: another tile is another candidate
        },
        unit="per layer",
    )


def _random(*shape: int, dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
    # a generator of its own: probing must not move the training's random stream
    g = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(requires_grad)


def _repeat(fn: Any) -> Workload:
    def run(calls: int) -> None:
        for _ in range(calls):
            fn()

    return run


def matmul_workloads(shapes: ModelShapes) -> Mapping[str, Workload]:
    """An MLP projection's forward and its backward to the activations, as a LoRA step runs
    them (the frozen base computes no weight gradient), in each dtype."""

    def pair(dtype: torch.dtype) -> Workload:
        x = _random(PROBE_ROWS, shapes.hidden, dtype=dtype)
        w = _random(shapes.hidden, shapes.intermediate, dtype=dtype)
        g = _random(PROBE_ROWS, shapes.intermediate, dtype=dtype)
        return _repeat(lambda: (x @ w, g @ w.t()))

    return {"fp32": pair(torch.float32), "bf16": pair(torch.bfloat16)}


def attention_workloads(shapes: ModelShapes, dtype: torch.dtype) -> Mapping[str, Workload]:
    """Forward and backward of per-sample causal attention over one packed row, upcast to
    fp32 (`fp32`) or in `dtype` (`native`)."""
    from kubetune.models.attention import per_sample_attention

    lengths = list(shapes.sample_lengths or (PROBE_ROWS,))
    t = sum(lengths)
    q, k, v = (_random(1, shapes.heads, t, shapes.head_dim, dtype=dtype, requires_grad=True) for _ in range(3))

    def layer(upcast: bool) -> Workload:
        def run() -> None:
            out = per_sample_attention(q, k, v, lengths, scaling=None, dropout=0.0, upcast=upcast)
            out.sum().backward()

        return _repeat(run)

    return {"fp32": layer(True), "native": layer(False)}


def grouped_workloads(shapes: ModelShapes, dtype: torch.dtype) -> Mapping[str, Workload]:
    """Forward and backward of the probe row's samples' attention in `dtype`, with either kernel."""
    from kubetune.models.attention import per_sample_attention

    lengths = list(shapes.grouped_lengths())
    t, kv = sum(lengths), shapes.kv_heads or shapes.heads
    q = _random(1, shapes.heads, t, shapes.head_dim, dtype=dtype, requires_grad=True)
    k, v = (_random(1, kv, t, shapes.head_dim, dtype=dtype, requires_grad=True) for _ in range(2))

    def layer(grouped_up_to: int) -> Workload:
        def run() -> None:
            out = per_sample_attention(q, k, v, lengths, None, 0.0, upcast=False, grouped_up_to=grouped_up_to)
            out.sum().backward()

        return _repeat(run)

    return {"flash": layer(0), "grouped": layer(GROUPED_MAX_TOKENS)}
