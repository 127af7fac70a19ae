"""The LM head at decode size: [rows x hidden] @ [vocab x hidden].T whole, and in slices of the
vocabulary, one thread, interleaved rounds, medians. SmolLM2's shapes by default.

    .venv/bin/python bench/experiments/head_slices.py [--rows 16] [--slices 2048,4096,8192]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: bench.common from this checkout
import torch.nn.functional as F
from bench.common.timing import time_interleaved

HIDDEN, VOCAB = 576, 49152


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--slices", default="2048,4096,8192")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    x, w = torch.randn(args.rows, HIDDEN), torch.randn(VOCAB, HIDDEN)

    def sliced(size: int) -> Callable[[], torch.Tensor]:
        parts = w.split(size)
        return lambda: torch.cat([F.linear(x, part) for part in parts], 1)

    arms: dict[str, Callable[[], torch.Tensor]] = {"whole": lambda: F.linear(x, w)}
    arms |= {f"slices of {n}": sliced(n) for n in map(int, args.slices.split(","))}
    times = time_interleaved(arms, args.rounds)
    flop = 2 * args.rows * VOCAB * HIDDEN
    print(
        f"torch {torch.__version__}, 1 thread, fp32, [{args.rows} x {HIDDEN}] @ [{VOCAB} x {HIDDEN}].T, "
        f"{args.rounds} interleaved rounds of 3 calls, medians:"
    )
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {name:16s} {median * 1e3:7.1f} ms  {flop / median / 1e9:5.1f} GFLOP/s")


if __name__ == "__main__":
    main()
