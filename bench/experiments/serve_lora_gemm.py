"""How a LoRA layer's second matmul joins the base GEMM (BENCHMARKS.md section 5): at the
decode shapes of SmolLM2 (16 or 64 rows, 576 -> 576 and 576 -> 1536, 4 adapters of rank 16
= 64 columns), median microseconds of

- base: the oneDNN-packed base GEMM alone;
- addmm: the packed base GEMM, then y + h @ B.T as one addmm;
- binary-add: h @ B.T, then the packed base GEMM with oneDNN's fused add;
- joint: [x | h] @ [W | B].T, one packed GEMM over the concatenated input (what engine/lora.py does).

    .venv/bin/python bench/experiments/serve_lora_gemm.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

lp = torch.ops.mkldnn._linear_pointwise


def timed(fn: Callable[[], object], n: int = 200) -> float:
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def arms(rows: int, out: int, rank_columns: int = 64) -> dict[str, Callable[[], torch.Tensor]]:
    x, h = torch.randn(1, rows, 576), torch.randn(1, rows, rank_columns)
    w, b = torch.randn(out, 576) * 0.02, torch.randn(out, rank_columns) * 0.02
    b_t = b.t().contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    joint = torch.ops.mkldnn._reorder_linear_weight(torch.cat([w, b], 1), rows)

    def addmm() -> torch.Tensor:
        y = lp(x, packed, None, "none", [], "")
        return torch.addmm(y.reshape(-1, out), h.reshape(-1, rank_columns), b_t).view(y.shape)

    def binary_add() -> torch.Tensor:
        delta = torch.mm(h.reshape(-1, rank_columns), b_t).view(1, rows, out)
        return torch.ops.mkldnn._linear_pointwise.binary(x, delta, packed, None, "add")

    return {
        "base": lambda: lp(x, packed, None, "none", [], ""),
        "addmm": addmm,
        "binary-add": binary_add,
        "joint": lambda: lp(torch.cat([x, h], -1), joint, None, "none", [], ""),
    }


def main() -> None:
    print(f"{torch.get_num_threads()} threads; median us of 5 rounds")
    for rows in (16, 64):
        for out in (576, 1536):
            fns = arms(rows, out)
            ref = fns["addmm"]()
            assert all(torch.allclose(ref, f(), atol=1e-4) for k, f in fns.items() if k != "base")
            times: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(5):
                for name, fn in fns.items():
                    times[name].append(timed(fn))
            medians = "  ".join(f"{k} {statistics.median(v):.0f}" for k, v in times.items())
            print(f"{rows:3d} rows, 576 -> {out:4d}: {medians}")


if __name__ == "__main__":
    main()
