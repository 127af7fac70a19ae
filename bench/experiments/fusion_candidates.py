"""Two elementwise fusions considered for the CPU training step and not built, each timed
against what transformers runs (forward and backward, fp32, one thread, SmolLM2-135M's shapes
for one packed row of `--tokens` tokens; medians of `--rounds`, arms interleaved; results and
gradients compared first):

- SwiGLU as one autograd function that keeps the sigmoid for backward, against
  `F.silu(gate) * up` (1,536 features);
- rotary embeddings with each half as a product and an `addcmul_` into one output, against
  `apply_rotary_pos_emb` (q: 9 heads, k: 3 heads of 64).

    .venv/bin/python bench/experiments/fusion_candidates.py [--tokens 476] [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        sig = torch.sigmoid(gate)
        silu = gate * sig
        ctx.save_for_backward(sig, silu, up)
        return silu * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sig, silu, up = ctx.saved_tensors
        slope = torch.addcmul(silu + sig, silu, sig, value=-1)  # silu'(g) = sig + silu (1 - sig)
        return (grad * up).mul_(slope), grad * silu


class Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, sign=1.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, sign=-1.0), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """x cos + rotate_half(x) sin (sign 1), or its transpose (sign -1), half by half."""
    h = x.shape[-1] // 2
    out = torch.empty_like(x)
    x1, x2, o1, o2 = x[..., :h], x[..., h:], out[..., :h], out[..., h:]
    torch.mul(x1, cos[..., :h], out=o1).addcmul_(x2, sin[..., :h] if sign > 0 else sin[..., h:], value=-sign)
    torch.mul(x2, cos[..., h:], out=o2).addcmul_(x1, sin[..., h:] if sign > 0 else sin[..., :h], value=sign)
    return out


def step(fn: Callable[..., Any], inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves = [x.clone().requires_grad_() for x in inputs]
    outs = fn(*leaves)
    torch.autograd.backward(list(outs), grads)
    return [*outs, *(x.grad for x in leaves)]


def race(name: str, arms: dict[str, Callable[[], list[torch.Tensor]]], rounds: int) -> None:
    ref, new = (arm() for arm in arms.values())
    worst = max((a - b).abs().max().item() for a, b in zip(ref, new, strict=True))
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(rounds):
        for k in arms if r % 2 == 0 else reversed(arms):
            t0 = time.perf_counter()
            arms[k]()
            times[k].append(time.perf_counter() - t0)
    (a, ta), (b, tb) = ((k, statistics.median(v) * 1e3) for k, v in times.items())
    print(f"{name}: {a} {ta:.3f} ms, {b} {tb:.3f} ms ({tb / ta:.2f}x the time); largest difference {worst:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=476)
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    t = args.tokens
    gate, up, g = (torch.randn(t, 1536) for _ in range(3))
    race(
        "SwiGLU",
        {
            "transformers": lambda: step(lambda a, b: [F.silu(a) * b], [gate, up], [g]),
            "one function": lambda: step(lambda a, b: [SwiGLU.apply(a, b)], [gate, up], [g]),
        },
        args.rounds,
    )
    q, k = torch.randn(1, 9, t, 64), torch.randn(1, 3, t, 64)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    angles = torch.randn(1, t, 64)
    cos, sin = angles.cos(), angles.sin()
    c4, s4 = cos.unsqueeze(1), sin.unsqueeze(1)
    race(
        "rotary",
        {
            "transformers": lambda: step(lambda a, b: apply_rotary_pos_emb(a, b, cos, sin), [q, k], [gq, gk]),
            "one function": lambda: step(
                lambda a, b: [Rotary.apply(a, c4, s4), Rotary.apply(b, c4, s4)], [q, k], [gq, gk]
            ),
        },
        args.rounds,
    )


if __name__ == "__main__":
    main()
