"""One LoRA-adapted linear layer, forward + backward, one thread, interleaved rounds, medians:
PEFT's module-by-module path (with kubetune's dropout) against kubetune.models.fused_lora;
then the rank-r products in both layouts, [tokens, r] and [r, tokens], which do the same
FLOPs. SmolLM2's q_proj shapes by default.

    .venv/bin/python bench/experiments/lora_layouts.py [--tokens 512] [--dim 576] [--rank 8] [--dropout 0.05]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: bench.common from this checkout
from bench.common.timing import time_interleaved


class Proj(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x)


def layer_arms(args: argparse.Namespace) -> dict[str, Callable[[], object]]:
    from peft import LoraConfig, get_peft_model

    from kubetune.models.dropout import use_fast_dropout
    from kubetune.models.fused_lora import use_fused_lora

    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=args.dropout, target_modules=["q_proj"])
    peft_model = get_peft_model(Proj(args.dim), config)
    use_fast_dropout(peft_model)
    fused = copy.deepcopy(peft_model)
    use_fused_lora(fused)
    x = torch.randn(1, args.tokens, args.dim, requires_grad=True)
    grad = torch.randn(1, args.tokens, args.dim)

    def step(model: nn.Module) -> Callable[[], object]:
        return lambda: model(x).backward(grad)

    return {"peft layer": step(peft_model.train()), "fused layer": step(fused.train())}


def product_arms(args: argparse.Namespace) -> dict[str, Callable[[], object]]:
    n, d, r = args.tokens, args.dim, args.rank
    x, g, a, b, h = torch.randn(n, d), torch.randn(n, d), torch.randn(r, d), torch.randn(d, r), torch.randn(n, r)
    return {
        "x @ A.T  -> [n, r]": lambda: x @ a.t(),
        "A @ x.T  -> [r, n]": lambda: a @ x.t(),
        "g @ B    -> [n, r]": lambda: g @ b,
        "B.T @ g.T -> [r, n]": lambda: b.t() @ g.t(),
        "g.T @ h  -> [d, r]": lambda: g.t() @ h,
        "h.T @ g  -> [r, d]": lambda: h.t() @ g,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--dim", type=int, default=576)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    for title, arms in (("layer, forward + backward", layer_arms(args)), ("rank-r products", product_arms(args))):
        times = time_interleaved(arms, args.rounds)
        print(f"{title} ({args.tokens} tokens, dim {args.dim}, rank {args.rank}, dropout {args.dropout}):")
        first = statistics.median(next(iter(times.values())))
        for name, ts in times.items():
            ms = statistics.median(ts) * 1e3
            print(f"  {name:22} {ms:8.3f} ms  x{first * 1e3 / ms:.2f} vs the first")


if __name__ == "__main__":
    main()
