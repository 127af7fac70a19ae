"""Data-parallel scaling and FSDP2 memory on this machine, side by side in one run.

(a) Scaling: the same recipe (SmolLM2-135M LoRA, rows of medical_flashcards train.jsonl)
    with 1 process x 1 thread (grad_accum 2) and with 2 processes x 1 thread (grad_accum 1,
    gloo on loopback): the same global batch and the same data, so the same math. Reports
    tokens/s of each and the ratio (ideal 2.0), and splits the 2-process step time into
    compute (the 1-process time per micro-batch) and communication + waiting (the rest).
(b) Memory: full fine-tune, 2 processes, DDP vs FSDP2 (parallel.fsdp=2): peak RSS per rank.
(c) Pipeline: 2 stages x 1 thread (parallel.pp=2, GPipe over the step's grad_accum
    micro-batches) against 1 process x 1 thread with the same grad_accum: tokens/s, ratio
    (ideal for GPipe: 2 x m / (m + 1) with m micro-batches) and peak RSS per rank.
    (SmolLM2 has 9 attention heads / 3 key-value heads: tensor parallelism over 2 processes
    does not divide it, so there is no tp arm on this model.)

    .venv/bin/python bench/train/scaling.py
    .venv/bin/python bench/train/scaling.py --rows 96 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data" / "medical_flashcards"


def train(args_list: list[str], nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
        cmd = [
            sys.executable,
            "-m",
            "kubetune",
            "train",
            *launch,
            *args_list,
            f"output_dir={tmp}/run",
            f"data.cache_dir={tmp}/cache",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        if res.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        metrics = [json.loads(ln) for ln in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    summary["metrics"] = metrics
    return summary


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--pp-micro", type=int, default=4, help="micro-batches per step in the pipeline arm")
    args = p.parse_args()
    common = [
        f"data.train={SHARED / 'train.jsonl'}",
        f"data.max_train_samples={args.rows}",
        "data.eval=0.1",
        "eval.max_samples=8",
        "eval.generate=0",
        "train.micro_batch_size=1",
        f"train.max_steps={args.steps}",
        "train.save_every=0",
        "train.num_threads=1",
        "train.log_every=1",
        "lora.dropout=0.0",
    ]
    one = train(common + ["train.grad_accum=2"], 1)
    two = train(common + ["train.grad_accum=1"], 2)

    # skip the first step in the rate (allocations, first-touch), same for both
    def rate(s):
        m = s["metrics"]
        return (m[-1]["tokens"] - m[0]["tokens"]) / (m[-1]["elapsed_s"] - m[0]["elapsed_s"])

    r1, r2 = rate(one), rate(two)
    step1 = (one["metrics"][-1]["elapsed_s"] - one["metrics"][0]["elapsed_s"]) / (len(one["metrics"]) - 1)
    step2 = (two["metrics"][-1]["elapsed_s"] - two["metrics"][0]["elapsed_s"]) / (len(two["metrics"]) - 1)
    compute = step1 / 2  # one micro-batch on one thread
    print(
        f"machine: {os.cpu_count()} cores; {args.rows} rows, {args.steps} steps, micro-batch 1 packed row of 512 "
        f"tokens, global batch 2 rows"
    )
    print(f"1 process x 1 thread : {r1:7.1f} tokens/s   step {step1:5.2f} s")
    print(
        f"2 processes x 1 thread: {r2:7.1f} tokens/s   step {step2:5.2f} s   scaling x{r2 / r1:.2f} "
        f"(efficiency {r2 / r1 / 2:.0%})"
    )
    print(
        f"2-process step split: compute {compute:.2f} s ({compute / step2:.0%}), communication + waiting "
        f"{step2 - compute:.2f} s ({(step2 - compute) / step2:.0%})"
    )
    print(f"same losses: 1p {one['metrics'][-1]['loss']:.4f} vs 2p {two['metrics'][-1]['loss']:.4f}")

    full = [c for c in common if not c.startswith("lora.")] + [
        "finetune.method=full",
        "train.grad_accum=1",
        "train.max_steps=2",
        "train.lr=1e-5",
    ]
    ddp = train(full, 2)
    fsdp = train(full + ["parallel.fsdp=2"], 2)
    ratio = max(fsdp["peak_rss_mb_per_rank"]) / max(ddp["peak_rss_mb_per_rank"])
    print(
        f"full fine-tune, 2 processes, peak RSS per rank: DDP {ddp['peak_rss_mb_per_rank']} MB, "
        f"FSDP2 {fsdp['peak_rss_mb_per_rank']} MB (x{ratio:.2f})"
    )

    m = args.pp_micro
    pp_common = common + [f"train.grad_accum={m}", f"train.max_steps={max(3, args.steps // m * 2)}"]
    one_m = train(pp_common, 1)
    pp = train(pp_common + ["parallel.pp=2"], 2)
    rp1, rp2 = rate(one_m), rate(pp)
    print(
        f"pipeline, {m} micro-batches per step: 1 process {rp1:.1f} tokens/s, 2 stages {rp2:.1f} tokens/s: "
        f"x{rp2 / rp1:.2f} (GPipe ideal x{2 * m / (m + 1):.2f}); losses {one_m['metrics'][-1]['loss']:.4f} vs "
        f"{pp['metrics'][-1]['loss']:.4f}; peak RSS per rank {one_m['peak_rss_mb_per_rank']} vs "
        f"{pp['peak_rss_mb_per_rank']} MB"
    )
    print(
        json.dumps(
            {
                "tps_1p": r1,
                "tps_2p": r2,
                "step_1p": step1,
                "step_2p": step2,
                "rss_ddp": ddp["peak_rss_mb_per_rank"],
                "rss_fsdp": fsdp["peak_rss_mb_per_rank"],
                "tps_pp_1p": rp1,
                "tps_pp_2stages": rp2,
                "rss_pp": pp["peak_rss_mb_per_rank"],
            }
        )
    )


if __name__ == "__main__":
    main()
