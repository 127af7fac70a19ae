"""Llama's RMSNorm, forward + backward to its input, as transformers computes it against
kubetune's fused autograd function (kubetune.models.fused_norm), on SmolLM2-135M's shape (one
packed row of 511 tokens x 576), fp32, one thread, frozen weight (a LoRA run's norms). Both
arms warmed, then interleaved rounds in alternating order, medians; the two results and input
gradients are compared first.

    .venv/bin/python bench/experiments/norm_parts.py [--rounds 15] [--tokens 511] [--hidden 576]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kubetune.models.fused_norm import use_fused_norms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=511)
    ap.add_argument("--hidden", type=int, default=576)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    weight = torch.rand(args.hidden, generator=g) + 0.5
    arms = {}
    for name in ("transformers", "fused"):
        norm = LlamaRMSNorm(args.hidden, eps=1e-5)
        norm.weight.data.copy_(weight)
        norm.weight.requires_grad_(False)
        if name == "fused":
            use_fused_norms(norm)
        arms[name] = norm
    x = torch.randn(args.tokens, args.hidden, generator=g, requires_grad=True)
    grad = torch.randn(args.tokens, args.hidden, generator=g)

    def run(norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        x.grad = None
        out = norm(x)
        out.backward(grad)
        return out.detach(), x.grad

    (out_a, dx_a), (out_b, dx_b) = run(arms["transformers"]), run(arms["fused"])
    print(
        f"max difference: output {(out_a - out_b).abs().max().item():.1e}, "
        f"input gradient {(dx_a - dx_b).abs().max().item():.1e}"
    )
    times: dict[str, list[float]] = {name: [] for name in arms}
    for norm in arms.values():
        run(norm), run(norm)
    calls = 20
    for r in range(args.rounds):
        for name in arms if r % 2 == 0 else reversed(arms):
            t = time.perf_counter()
            for _ in range(calls):
                run(arms[name])
            times[name].append((time.perf_counter() - t) / calls * 1e3)
    a, b = statistics.median(times["transformers"]), statistics.median(times["fused"])
    print(f"[{args.tokens} x {args.hidden}] fp32, 1 thread, forward + backward, medians of {args.rounds} rounds:")
    print(f"transformers LlamaRMSNorm {a:.3f} ms, fused {b:.3f} ms: {a / b:.2f}x")


if __name__ == "__main__":
    main()
