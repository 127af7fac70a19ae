"""The processes question of `kubetune train` (kubetune.training.processes) on the bench
recipe (bench/train/train_vs_hf.py's 160 rows, micro-batch 2), measured afresh `--runs` times,
and, beside it, the LM head alone: `target_cross_entropy` forward and backward over
`--targets` rows in one process with `--cores` threads, against `--cores` single-thread
processes at once, each on its share of the rows. The head is why the probe times a
layer's share of it: it gains more from processes than the layer does.

    .venv/bin/python bench/experiments/processes_probe.py [--runs 3] [--targets 512] [--cores 2]

Run it with nothing else on the machine; the probe's own cache is a temporary one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def head_ms_per_k(threads: int, rows: int, rounds: int = 15) -> float:
    """Milliseconds per 1k target rows of the chunked head (SmolLM2's 49,152 x 576), median."""
    import torch

    from kubetune.models.lm_loss import target_cross_entropy

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(49152, 576, generator=g) * 0.02
    hidden = torch.randn(rows, 576, generator=g).requires_grad_()
    targets = torch.randint(0, 49152, (rows,), generator=g)

    def once() -> None:
        target_cross_entropy(hidden, weight, targets).backward()

    for _ in range(3):
        once()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6 / rows


def head_side_by_side(cores: int, rows: int) -> None:
    one = head_ms_per_k(cores, rows)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(HERE), "--head-only", str(rows // cores)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(cores)]
    each = [float(p.communicate()[0]) for p in procs]
    together = statistics.mean(each) / cores  # cores processes each do 1/cores of the rows at once
    print(f"LM head, {rows} target rows: 1 x {cores} threads {one:.0f} ms per 1k targets; "
          f"{cores} x 1 thread at once {', '.join(f'{e:.0f}' for e in each)} ms per 1k of their own "
          f"rows each, {together:.0f} together: processes at {together / one:.2f} of the threads' time")  # fmt: skip


def probe(runs: int, cores: int) -> None:
    sys.path.insert(0, str(HERE.parents[1] / "train"))
    import train_vs_hf

    from kubetune.recipe import load_recipe
    from kubetune.training.processes import measure_processes

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KUBETUNE_CACHE"] = f"{tmp}/cache"
        bench_args = argparse.Namespace(rows=160, eval_rows=8, kt_extra="")
        overrides = [o for o in train_vs_hf.kubetune_overrides(bench_args, "fp32", tmp, 1, 2) if "num_threads" not in o]
        recipe = load_recipe(None, overrides).recipe
        for i in range(runs):
            print(f"probe {i + 1}: {measure_processes(recipe, cores, (1, 1), remeasure=True).describe()}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="fresh measurements of the processes question")
    p.add_argument("--targets", type=int, default=512, help="the head's target rows (one process's share: / cores)")
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--head-only", type=int, help=argparse.SUPPRESS)  # a worker: its ms per 1k rows
    args = p.parse_args()
    if args.head_only:
        print(head_ms_per_k(1, args.head_only))
        return
    os.environ.pop("OMP_NUM_THREADS", None)
    head_side_by_side(args.cores, args.targets)
    probe(args.runs, args.cores)


if __name__ == "__main__":
    main()
