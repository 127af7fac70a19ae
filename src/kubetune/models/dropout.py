"""LoRA's input dropout with a quarter of the random draws.

PEFT drops out each adapted module's input before `lora_A`: one mask the size of the
activations per module and micro-batch. On CPU, torch's dropout draws one random number
per element (bernoulli), and the generator, not the multiply, is the cost: with LoRA on
q and v it was the third-largest item of a step's profile (BENCHMARKS.md). Here one 64-bit
draw gives four 16-bit lanes, each compared with a threshold: the keep probability is
`1 - t / 65536` with `t = round(p * 65536)` (p to within 1/131072) and the kept values are
scaled by exactly its inverse, so the expectation is the input's, as with torch's dropout.
The draws come from torch's default generator, so seeding and a checkpoint's RNG state
cover them like any other.

Tensors other than plain ones (DTensor under tensor parallelism) keep torch's dropout,
whose RNG DTensor coordinates across ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LANES = 65536  # values of one 16-bit lane
INT16_MIN = -32768


class FastDropout(nn.Module):
    """Drop-in for nn.Dropout(p) on LoRA inputs (see the module docstring)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), not {p}")
        self.p = p
        self.threshold = round(p * LANES)
        self.scale = LANES / (LANES - self.threshold)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.threshold == 0:
            return x
        if type(x) is not torch.Tensor:
            return F.dropout(x, self.p, True)
        return _Dropout.apply(x, keep_mask(x.shape, self.threshold, x.device), self.scale)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def keep_mask(shape: torch.Size, threshold: int, device: torch.device) -> torch.Tensor:
    """A bool mask, True with probability 1 - threshold / 65536, from one 64-bit draw per four elements."""
    n = shape.numel()
    draws = torch.empty(-(-n // 4), dtype=torch.int64, device=device).random_(-(2**63), 2**63 - 1)
    return (draws.view(torch.int16)[:n] >= INT16_MIN + threshold).view(shape)


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.where(keep, x, 0.0).mul_(scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        return torch.where(keep, grad, 0.0).mul_(ctx.scale), None, None


def use_fast_dropout(model: nn.Module) -> int:
    """Replace PEFT's nn.Dropout on every LoRA input; returns how many were replaced."""
    replaced = 0
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, nn.ModuleDict):
            continue
        for name, d in dropouts.items():
            if isinstance(d, nn.Dropout):
                dropouts[name] = FastDropout(d.p)
                replaced += 1
    return replaced
