"""Where a kubetune LoRA step on the ~1B Llama of lora_1b.py goes on a GPU: a steady run's
per-step figures from its metrics.jsonl (and its steady windows: tokens/s between logged steps
over the run's second half, the median and the slowest, where stalls show), then torch's
profiler over a whole short run. `--set KEY=VALUE` overrides the recipe of both runs (e.g.
`train.grad_accum=1` with `--rows 16`: the same global batch as one micro-batch);
`--no-cudnn-attention` keeps cuDNN's kernel out of SDPA.

`--compile` runs the steady run with `train.compile=true` (regional compile of each layer's
MLP and norms; its per-step figures, after the compile, are what `train.compile=auto` would
weigh). The profiled run includes set-up (loading, moving the weights to the device: the pageable
host-to-device copies), since `kubetune train` has no profiler hook; its per-step share is
what remains after those. Tables: operators by self CUDA time and by self CPU time.

    python bench/train/lora_1b_profile.py --tokenizer DIR --data train.jsonl     # a CUDA machine; ~3 min
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lora_1b  # a sibling script, not a package


def print_windows(logged: list[dict]) -> None:
    """Tokens/s between consecutive logged steps over the run's second half (wall time: data,
    compute, optimizer and logging), their median and the slowest: a steady figure without
    set-up's first steps, and the stalls."""
    pairs = list(itertools.pairwise(logged))[len(logged) // 2 :]
    rates = [
        ((a["step"], b["step"]), (b["tokens"] - a["tokens"]) / max(b["elapsed_s"] - a["elapsed_s"], 1e-3))
        for a, b in pairs
    ]
    if not rates:
        return
    slowest = sorted(rates, key=lambda r: r[1])[:3]
    print(
        f"steady windows: {len(rates)}, median {statistics.median(r for _, r in rates):,.0f} tokens/s; slowest "
        + ", ".join(f"steps {a}-{b} {r:,.0f}" for (a, b), r in slowest)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", help="a saved tokenizer's folder (default: the embedded model's)")
    p.add_argument("--data", default=str(lora_1b.DATA))
    p.add_argument("--steps", type=int, default=90, help="steps of the steady (unprofiled) run")
    p.add_argument("--profiled-steps", type=int, default=8)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    p.add_argument("--compile", action="store_true", help="the steady run with train.compile=true")
    p.add_argument("--no-profile", action="store_true", help="the steady run only")
    p.add_argument(
        "--no-cudnn-attention", action="store_true", help="SDPA without cuDNN's kernel (its graphs are built per shape)"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override for both runs")
    args = p.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from kubetune.training.run import train_from_recipe

    if args.no_cudnn_attention:
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)
    model = lora_1b.make_model(Path(tempfile.mkdtemp()), args.tokenizer)
    run = argparse.Namespace(steps=args.steps, rows=args.rows, data=args.data, device=args.device)
    tmp = tempfile.mkdtemp()
    overrides = [o for o in lora_1b.kubetune_overrides(model, run, tmp) if not o.startswith("train.log_every")]
    compiled = ["train.compile=true"] if args.compile else []
    summary = train_from_recipe(None, [*overrides, "train.log_every=5", *compiled, *args.set])
    assert summary is not None
    mode = " ".join(["compiled" if args.compile else "eager", f"{args.rows} rows", *args.set])
    print(f"steady run ({mode}): {summary.tokens_per_s} tokens/s over {summary.train_tokens} tokens")
    metrics = Path(tmp, "run", "metrics.jsonl").read_text().splitlines()
    for line in metrics[-4:]:
        print(line)
    print_windows([json.loads(line) for line in metrics if line.startswith('{"step"')])
    if args.device == "cuda":
        import torch

        print(f"peak CUDA memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if args.no_profile:
        return
    run.steps = args.profiled_steps
    t = time.perf_counter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        train_from_recipe(None, [*lora_1b.kubetune_overrides(model, run, tempfile.mkdtemp()), *args.set])
    print(f"profiled run (set-up included): {time.perf_counter() - t:.1f} s")
    table = prof.key_averages()
    for key in ("self_cuda_time_total", "self_cpu_time_total") if args.device == "cuda" else ("self_cpu_time_total",):
        print(table.table(sort_by=key, row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
