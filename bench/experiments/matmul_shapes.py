"""The training step's own matmul shapes, each timed alone: how close each runs to this CPU's
peak, and whether the operand layout matters.

SmolLM2-135M (hidden 576, MLP 1536, 9 query heads and 3 K/V heads of 64, vocabulary 49152),
T tokens per micro-batch. For each frozen linear layer [out x in] the step runs
- forward: x [T x in] @ W.T (F.linear, W as stored),
- backward to the input: g [T x out] @ W [out x in] (autograd's mm),
and the LM head on the target tokens only (T/2 rows here). Beside each, the same product with
the weight's other layout (a contiguous W.T), to see whether a layout costs the BLAS its speed.
Reported: GFLOP/s (median of `--repeats` timed rounds of >= 0.2 s each, after a warm-up) and
the share of the 2048^3 peak. One thread unless --threads.

    .venv/bin/python bench/experiments/matmul_shapes.py [--tokens 1024] [--threads 1] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

HIDDEN, MLP, HEAD_DIM, HEADS, KV_HEADS, VOCAB = 576, 1536, 64, 9, 3, 49152
LAYERS = {  # name: (out, in)
    "q_proj / o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "k_proj, v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "gate_proj, up_proj": (MLP, HIDDEN),
    "down_proj": (HIDDEN, MLP),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def gflops(fn: Callable[[], torch.Tensor], flop: float, repeats: int) -> float:
    fn()
    rounds = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < 0.2:
            fn()
            n += 1
        rounds.append(flop * n / elapsed / 1e9)
    return statistics.median(rounds)


def shapes(tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, rows, out, in) for every product of the step."""
    rows = [(f"{name}", tokens, out, inp) for name, (out, inp) in LAYERS.items()]
    return [*rows, ("lm_head (targets)", tokens // 2, VOCAB, HIDDEN)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    peak = gflops(lambda: a @ b, 2 * 2048**3, args.repeats)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.dtype}; 2048^3 peak {peak:.1f} GFLOP/s")
    print(f"{'product':<38} {'GFLOP/s':>8} {'of peak':>8} | {'other layout':>12} {'of peak':>8}")
    for name, rows, out, inp in shapes(args.tokens):
        for label, flop, as_trained, other in products(name, rows, out, inp, dtype):
            ours, alt = gflops(as_trained, flop, args.repeats), gflops(other, flop, args.repeats)
            print(f"{label:<38} {ours:8.1f} {ours / peak:8.0%} | {alt:12.1f} {alt / peak:8.0%}")


Product = tuple[str, float, Callable[[], torch.Tensor], Callable[[], torch.Tensor]]


def products(name: str, rows: int, out: int, inp: int, dtype: torch.dtype) -> list[Product]:
    """The forward and the backward to the input of one layer: as trained, and with W.T stored."""
    w = torch.randn(out, inp, dtype=dtype)
    wt = w.t().contiguous()
    x, g = torch.randn(rows, inp, dtype=dtype), torch.randn(rows, out, dtype=dtype)
    flop = 2 * rows * out * inp
    return [
        (f"{name} forward [{rows}x{inp}]@W.T", flop, lambda: F.linear(x, w), lambda: x @ wt),
        (f"{name} grad_in [{rows}x{out}]@W", flop, lambda: g @ w, lambda: g @ wt.t()),
    ]


if __name__ == "__main__":
    main()
