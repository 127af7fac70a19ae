"""Kernel choices by measurement, not by the CPU a developer happened to have.

Which compute precision and which attention kernel are fastest depends on the machine:
bf16 matmuls run on AMX tiles on a 4th-generation Xeon, on AVX-512-BF16 on a Zen 4 EPYC,
and, on a CPU with neither (AVX2 only), through a slow conversion path that can be 30x
slower than fp32. So where the recipe says `auto`, a short probe on the model's own shapes
decides at start-up (well under a second on a machine where one candidate is clearly
slower: a candidate is dropped as soon as one call of it is far slower than the best),
the result is cached per CPU model, ISA level, torch version, thread count and shape in
the kubetune cache, and the choice is logged in one line:

    kernels: precision=fp32 (bf16 612.4 ms vs fp32 10.9 ms per 256x576x1536 matmul pair), ...

Accelerators are not probed: CUDA and Gaudi run bf16 natively (fp16 on CUDA devices
without bf16), and their attention runs in the compute dtype.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kubetune.fsutil import atomic_write_json, cache_root

log = logging.getLogger("kubetune")

PROBE_VERSION = 1  # bump when a probe's workload changes: old cached choices are then ignored
SLOWER_CUTOFF = 3.0  # one call this many times slower than the best candidate: stop timing it
PROBE_ROWS = 256  # tokens per probe matmul: large enough to reach the kernel's steady speed
BF16_MARGIN = 0.9  # bf16 changes the numerics: choose it only when clearly faster (<= 90% of fp32)


@dataclass(frozen=True)
class ModelShapes:
    """The shapes a probe runs on: the model's projections and one packed row's samples."""

    hidden: int
    intermediate: int
    heads: int
    head_dim: int
    sample_lengths: tuple[int, ...]

    @classmethod
    def of(cls, config: Any, sample_lengths: list[int]) -> ModelShapes:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.hidden_size, config.intermediate_size, heads, head_dim, tuple(sample_lengths))


@dataclass(frozen=True)
class KernelPlan:
    precision: str  # bf16 | fp16 | fp32: the autocast dtype of the compute
    attention: str  # fp32 (samples upcast to fp32 for the flash kernel) | native (the compute dtype)
    evidence: tuple[str, ...] = ()  # one phrase per measured choice
    cached: bool = False

    def describe(self) -> str:
        why = f" ({'; '.join(self.evidence)})" if self.evidence else ""
        cached = " [cached]" if self.cached else ""
        return f"kernels: precision={self.precision}, attention={self.attention}{why}{cached}"


def choose(precision: str, attention: str, shapes: ModelShapes, device: torch.device) -> KernelPlan:
    """Resolve `auto` choices: probe (or read the cache) on CPU, known facts elsewhere."""
    if device.type != "cpu":
        return _accelerator_plan(precision, attention, device)
    if precision != "auto" and (attention != "auto" or precision == "fp32"):
        return KernelPlan(precision, "fp32" if precision == "fp32" else attention)  # nothing to probe
    key = _cache_key(shapes)
    cached = _read_cache(key) or {}
    timings = dict(cached)
    if precision == "auto" and "matmul_fp32" not in timings:
        timings.update(probe_matmuls(shapes))
    # the attention question only exists in half precision: an fp32 run never times it
    half = precision if precision != "auto" else _precision_from(timings)
    if half != "fp32" and attention == "auto" and "attention_fp32" not in timings:
        timings.update(probe_attention(shapes, torch.float16 if half == "fp16" else torch.bfloat16))
    if timings != cached:
        _write_cache(key, timings)
    plan = _plan_from(timings, precision, attention)
    return KernelPlan(plan.precision, plan.attention, plan.evidence, cached=timings == cached)


def _accelerator_plan(precision: str, attention: str, device: torch.device) -> KernelPlan:
    if precision == "auto":
        bf16 = device.type != "cuda" or torch.cuda.is_bf16_supported()
        precision = "bf16" if bf16 else "fp16"
    return KernelPlan(precision, "native" if attention == "auto" else attention)


def _plan_from(timings: dict[str, float], precision: str, attention: str) -> KernelPlan:
    """The choices the timings (ms) support; explicit recipe values always win."""
    evidence = []
    if precision == "auto":
        precision = _precision_from(timings)
        evidence.append(f"bf16 {timings['matmul_bf16']:.1f} ms vs fp32 {timings['matmul_fp32']:.1f} ms per matmul pair")
    if precision == "fp32":
        return KernelPlan("fp32", "fp32", tuple(evidence))
    if attention == "auto":
        native, upcast = timings["attention_half"], timings["attention_fp32"]
        attention = "native" if native < upcast else "fp32"
        evidence.append(f"attention {precision} {native:.1f} ms vs fp32 {upcast:.1f} ms per layer")
    return KernelPlan(precision, attention, tuple(evidence))


def _precision_from(timings: dict[str, float]) -> str:
    return "bf16" if timings["matmul_bf16"] <= BF16_MARGIN * timings["matmul_fp32"] else "fp32"


# --- the probes -------------------------------------------------------------------------


def probe_matmuls(shapes: ModelShapes) -> dict[str, float]:
    """Milliseconds per bf16 and fp32 matmul pair on `shapes` (a slow candidate is cut short)."""
    fp32 = _time(_matmul_pair(shapes, torch.float32))
    return {"matmul_fp32": fp32, "matmul_bf16": _time(_matmul_pair(shapes, torch.bfloat16), rival=fp32)}


def probe_attention(shapes: ModelShapes, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Milliseconds per layer of per-sample attention upcast to fp32 and in `dtype`."""
    upcast = _time(_attention(shapes, dtype, upcast=True))
    return {"attention_fp32": upcast, "attention_half": _time(_attention(shapes, dtype, upcast=False), rival=upcast)}


def _random(*shape: int, dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
    # a generator of its own: probing must not move the training's random stream
    g = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(requires_grad)


def _matmul_pair(shapes: ModelShapes, dtype: torch.dtype) -> Callable[[], object]:
    """An MLP projection's forward and its backward to the activations, as training runs them."""
    x = _random(PROBE_ROWS, shapes.hidden, dtype=dtype)
    w = _random(shapes.hidden, shapes.intermediate, dtype=dtype)
    g = _random(PROBE_ROWS, shapes.intermediate, dtype=dtype)
    return lambda: (x @ w, g @ w.t())


def _attention(shapes: ModelShapes, dtype: torch.dtype, upcast: bool) -> Callable[[], object]:
    """Forward and backward of per-sample causal attention over one packed row."""
    from kubetune.models.attention import per_sample_attention

    t = sum(shapes.sample_lengths)
    q, k, v = (_random(1, shapes.heads, t, shapes.head_dim, dtype=dtype, requires_grad=True) for _ in range(3))

    def run() -> None:
        out = per_sample_attention(q, k, v, list(shapes.sample_lengths), scaling=None, dropout=0.0, upcast=upcast)
        out.sum().backward()

    return run


def _time(fn: Callable[[], object], rival: float | None = None, repeats: int = 3) -> float:
    """Best of `repeats` calls in ms after a warm-up; one call when it is far slower than `rival`."""
    t0 = time.perf_counter()
    fn()  # warm-up (and, for a hopeless candidate, the only call)
    first = (time.perf_counter() - t0) * 1e3
    if rival is not None and first > SLOWER_CUTOFF * rival:
        return first
    best = first
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


# --- the cache --------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_key(shapes: ModelShapes) -> str:
    parts = {
        "probe": PROBE_VERSION,
        "cpu": cpu_model(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shapes": asdict(shapes),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def _cache_file(key: str) -> Path:
    return cache_root() / "kernels" / f"{key}.json"


def _read_cache(key: str) -> dict[str, float] | None:
    try:
        data = json.loads(_cache_file(key).read_text())
    except (OSError, ValueError):
        return None
    return {k: float(v) for k, v in data.items()}


def _write_cache(key: str, timings: dict[str, float]) -> None:
    path = _cache_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, timings)
