"""Linear layers with weights pre-packed for oneDNN, where that is measured to be faster.

A decode step multiplies a few rows (one per running sequence) by every weight matrix; the
plain GEMM path re-reads the weight in its stored layout each time, while oneDNN's packed
layout (reordered once at load, as inductor's freezing and vLLM's CPU backend do) feeds its
micro-kernels directly. On the AVX2 EPYC of BENCHMARKS.md the LM head went from 31 to 12 ms at
16 rows. Whether it wins depends on the CPU and the shape, so each distinct weight shape is
timed both ways at start-up on the serving batch size, and only the winners are packed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

MIN_GAIN = 0.9  # pack only when the packed path takes at most 90% of the plain one


def _linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """nn.Linear's forward over a oneDNN-packed copy of the weight (the plain weight is dropped,
    unless another module shares it: a tied LM head keeps the embedding's)."""

    def __init__(self, linear: nn.Linear, rows_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)
        bias = getattr(linear, "bias", None)  # None for bias-free layers, whatever the stubs say
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear_packed(x, self.packed, self.bias)


def _time(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _race(module: nn.Linear, rows: int) -> tuple[float, float]:
    x = torch.randn(rows, module.in_features, dtype=module.weight.dtype)
    weight = module.weight.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return _time(lambda: F.linear(x, weight)), _time(lambda: _linear_packed(x, packed, None))


def available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def choose_shapes(model: nn.Module, rows: int) -> dict[tuple[int, int, torch.dtype], tuple[float, float]]:
    """For each distinct linear shape: (plain seconds, packed seconds) at `rows` rows."""
    timings: dict[tuple[int, int, torch.dtype], tuple[float, float]] = {}
    with torch.inference_mode():
        for module in model.modules():
            if type(module) is not nn.Linear:
                continue
            key = (module.in_features, module.out_features, module.weight.dtype)
            if key in timings:
                continue
            timings[key] = _race(module, rows)
    return timings


def pack(model: nn.Module, rows: int, only_faster: bool = True) -> str:
    """Replace the linear layers whose shape runs faster packed (every one with
    `only_faster=False`); returns a one-line account."""
    if not available():
        return "linear: plain (oneDNN is not available in this torch)"
    timings = choose_shapes(model, rows)
    winners = {k for k, (plain, packed) in timings.items() if packed <= MIN_GAIN * plain or not only_faster}
    replaced = 0
    with torch.inference_mode():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and (child.in_features, child.out_features, child.weight.dtype) in winners:
                    setattr(parent, name, PackedLinear(child, rows))
                    replaced += 1
    largest = max(timings, key=lambda k: k[0] * k[1])
    plain, packed = timings[largest]
    return (
        f"linear: oneDNN-packed for {len(winners)}/{len(timings)} weight shapes ({replaced} layers; "
        f"{largest[0]}x{largest[1]}: {packed * 1e3:.1f} vs {plain * 1e3:.1f} ms plain at {rows} rows)"
    )
