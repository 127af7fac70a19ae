"""Linear layers with weights pre-packed for oneDNN, unless that is measured to be slower.

A decode step multiplies a few rows (one per running sequence) by every weight matrix; the
plain GEMM path re-reads the weight in its stored layout each time, while oneDNN's packed
layout (reordered once at load, as inductor's freezing and vLLM's CPU backend do) feeds its
micro-kernels directly. Whether it wins depends on the CPU and the shape (the measurements are
in BENCHMARKS.md, "What the serving engine's choices measured"), so each distinct weight shape
is timed both ways at start-up on the serving batch size, and a shape stays plain only where
the plain path is clearly faster.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

PLAIN_MARGIN = 0.9  # a shape stays plain only when it takes at most 90% of the packed time
COLD_BYTES = 96 << 20  # weights are raced in copies of at least this much: beyond a CPU's last-level cache
MAX_COPIES = 256  # ... but never more copies than this (a tiny test model's weights)
ROUNDS = 5


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


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _race(module: nn.Linear, rows: int) -> tuple[float, float]:
    """Seconds per call, plain and packed: the medians of rounds that alternate the two, so
    that a shared machine slowing down for a moment slows both. In a forward each weight is
    read once per step, long after the cache dropped it, so each round cycles through copies
    larger than any last-level cache: a race on one hot weight measures a cache the decode
    step never has, and picked plain for shapes where cold plain is slower."""
    weight = module.weight.detach()
    count = min(MAX_COPIES, max(1, -(-COLD_BYTES // (weight.numel() * weight.itemsize))))
    copies = [weight.clone() for _ in range(count)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in copies]
    x = torch.randn(rows, module.in_features, dtype=weight.dtype)
    plain_fn = lambda: [F.linear(x, w) for w in copies]  # noqa: E731
    packed_fn = lambda: [_linear_packed(x, p, None) for p in packed]  # noqa: E731
    plain_fn(), packed_fn()
    rounds = [(_seconds(plain_fn), _seconds(packed_fn)) for _ in range(ROUNDS)]
    return (
        statistics.median(r[0] for r in rounds) / len(copies),
        statistics.median(r[1] for r in rounds) / len(copies),
    )


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
    """Replace the linear layers of every shape that is not clearly faster plain (every one,
    without a race, with `only_faster=False`); returns a one-line account."""
    if not available():
        return "linear: plain (oneDNN is not available in this torch)"
    shapes = {(m.in_features, m.out_features, m.weight.dtype) for m in model.modules() if type(m) is nn.Linear}
    timings = choose_shapes(model, rows) if only_faster else {}
    winners = {k for k, (plain, packed) in timings.items() if plain > PLAIN_MARGIN * packed} if only_faster else shapes
    replaced = 0
    with torch.inference_mode():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and (child.in_features, child.out_features, child.weight.dtype) in winners:
                    setattr(parent, name, PackedLinear(child, rows))
                    replaced += 1
    line = f"linear: oneDNN-packed for {len(winners)}/{len(shapes)} weight shapes ({replaced} layers"
    if not timings:
        return line + ", not raced)"
    largest = max(timings, key=lambda k: k[0] * k[1])
    plain, packed = timings[largest]
    return line + f"; {largest[0]}x{largest[1]}: {packed * 1e3:.1f} vs {plain * 1e3:.1f} ms plain at {rows} rows)"
