"""Would one matmul for q/k/v (and one for gate/up) beat three (and two) on a CPU? SmolLM2-135M's
shapes, 512 rows, forward and input-gradient products of frozen weights, one thread, rounds
interleaved, medians.

    .venv/bin/python bench/experiments/fused_projections.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

ROWS, HIDDEN, INTER, KV = 512, 576, 1536, 192


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(ROWS, HIDDEN)
    wq, wk, wv = torch.randn(HIDDEN, HIDDEN), torch.randn(KV, HIDDEN), torch.randn(KV, HIDDEN)
    wqkv = torch.cat([wq, wk, wv])
    wg, wu = torch.randn(INTER, HIDDEN), torch.randn(INTER, HIDDEN)
    wgu = torch.cat([wg, wu])
    gq, gk, gv = torch.randn(ROWS, HIDDEN), torch.randn(ROWS, KV), torch.randn(ROWS, KV)
    gqkv = torch.cat([gq, gk, gv], 1)
    gg, gu = torch.randn(ROWS, INTER), torch.randn(ROWS, INTER)
    ggu = torch.cat([gg, gu], 1)

    def qkv_apart() -> None:
        x @ wq.T, x @ wk.T, x @ wv.T
        (gq @ wq).addmm_(gk, wk).addmm_(gv, wv)

    def qkv_fused() -> None:
        x @ wqkv.T, gqkv @ wqkv

    def gate_up_apart() -> None:
        x @ wg.T, x @ wu.T
        (gg @ wg).addmm_(gu, wu)

    def gate_up_fused() -> None:
        x @ wgu.T, ggu @ wgu

    flops = {"q/k/v": 2 * 2 * ROWS * HIDDEN * (HIDDEN + 2 * KV), "gate/up": 2 * 2 * ROWS * HIDDEN * 2 * INTER}
    arms = {
        ("q/k/v", "apart"): qkv_apart,
        ("q/k/v", "fused"): qkv_fused,
        ("gate/up", "apart"): gate_up_apart,
        ("gate/up", "fused"): gate_up_fused,
    }
    times: dict[tuple[str, str], list[float]] = {k: [] for k in arms}
    for _ in range(args.rounds):
        for key, fn in arms.items():
            fn()
            t = time.perf_counter()
            for _ in range(5):
                fn()
            times[key].append((time.perf_counter() - t) / 5)
    for (what, how), ts in times.items():
        m = statistics.median(ts)
        print(f"{what:8s} {how:6s} {m * 1e3:8.3f} ms  {flops[what] / m / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
