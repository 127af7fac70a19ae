"""Where one training step goes: the torch profiler over steps 4-12 of the train_vs_hf
kubetune arm (160 rows of medical_flashcards, LoRA r=8 q/v, dropout 0.05, 2 threads), in the
precision given (default `auto`: what the start-up probe chooses on this CPU; bf16 on a CPU
without bf16 units would take hours).

    .venv/bin/python bench/experiments/profile_step.py [auto|bf16|fp32] [extra recipe overrides...]

With PROFILE_THREADS=N it runs N threads (default 2); with PROFILE_SHAPES=1 it also prints
the matmuls (`aten::mm`, `aten::addmm`, `aten::bmm`) by input shape, to split the matmul time
between the base weights, LoRA's factors and the LM head.
"""

import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import kubetune.training.run as run

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "medical_flashcards"
orig = run.train_step
n = {"i": 0}
PRECISION = sys.argv[1] if len(sys.argv) > 1 else "auto"
SHAPES = os.environ.get("PROFILE_SHAPES") == "1"
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=SHAPES)


def print_matmuls_by_shape() -> None:
    rows = [
        e for e in prof.key_averages(group_by_input_shape=True) if e.key in ("aten::mm", "aten::addmm", "aten::bmm")
    ]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    print(f"{'op':12} {'calls':>6} {'self ms':>9} {'% of all':>8}  shapes")
    for e in rows[:40]:
        share = 100 * e.self_cpu_time_total / total
        print(f"{e.key:12} {e.count:6d} {e.self_cpu_time_total / 1e3:9.0f} {share:7.1f}%  {e.input_shapes}")


def step(*a, **k):
    n["i"] += 1
    if n["i"] == 4:
        prof.__enter__()
        n["t0"] = time.perf_counter()
    r = orig(*a, **k)
    if n["i"] == 12:
        wall = time.perf_counter() - n["t0"]
        prof.__exit__(None, None, None)
        print(f"steps 4-12: {wall:.1f} s of wall time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=35))
        if SHAPES:
            print_matmuls_by_shape()
    return r


run.train_step = step
with tempfile.TemporaryDirectory() as tmp:
    run.train_from_recipe(
        None,
        [
            f"data.train={SHARED / 'train.jsonl'}",
            f"data.eval={SHARED / 'test.jsonl'}",
            "data.max_train_samples=160",
            "eval.max_samples=20",
            "eval.generate=0",
            "lora.r=8",
            "lora.alpha=16",
            "lora.dropout=0.05",
            "lora.target_modules=[q_proj,v_proj]",
            "train.max_steps=14",
            "train.micro_batch_size=2",
            "train.grad_accum=1",
            f"train.precision={PRECISION}",
            "train.save_every=0",
            f"train.num_threads={os.environ.get('PROFILE_THREADS', '2')}",
            f"data.cache_dir={tmp}/c",
            f"output_dir={tmp}/r",
            "train.log_every=1000",
            *sys.argv[2:],
        ],
    )
