"""Quality: one epoch of LoRA on medical_flashcards train.jsonl, perplexity on test.jsonl,
before and after, in bf16 and in fp32 (the seed reports 3.19 vs 3.21 for Llama-2-7B).

    .venv/bin/python bench/train/quality.py                          # bf16 and fp32, all 4,268 rows
    .venv/bin/python bench/train/quality.py --precisions bf16 --rows 2000

Uses the embedded default recipe (SmolLM2-135M-Instruct, LoRA r=16 on q/k/v/o) with the
shared data; eval on all 500 test rows (never trained on). Prints one line per precision
and a JSON record; the runs stay in runs/bench-quality-<precision>/.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data" / "medical_flashcards"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--precisions", default="bf16,fp32")
    p.add_argument("--rows", type=int, default=None, help="train rows (default: all)")
    p.add_argument("--eval-rows", type=int, default=500)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--tag", default="", help="suffix of the run directories")
    p.add_argument("overrides", nargs="*", help="extra recipe overrides, e.g. lora.target_modules=all-linear")
    args = p.parse_args()

    from kubetune.training.run import train_from_recipe

    results = {}
    for precision in args.precisions.split(","):
        out = REPO / "runs" / f"bench-quality-{precision}{args.tag}"
        shutil.rmtree(out, ignore_errors=True)
        overrides = (
            [
                f"data.train={SHARED / 'train.jsonl'}",
                f"data.eval={SHARED / 'test.jsonl'}",
                f"eval.max_samples={args.eval_rows}",
                "eval.generate=2",
                "train.epochs=1",
                "train.lr=5e-4",
                f"train.micro_batch_size={args.micro_batch}",
                f"train.grad_accum={args.grad_accum}",
                "train.warmup_steps=10",
                f"train.precision={precision}",
                "train.save_every=100",
                "train.log_every=10",
                f"output_dir={out}",
            ]
            + ([f"data.max_train_samples={args.rows}"] if args.rows else [])
            + args.overrides
        )
        s = train_from_recipe(None, overrides)
        drop = 1 - s.perplexity_after / s.perplexity_before
        results[precision] = {
            k: getattr(s, k)
            for k in (
                "perplexity_before",
                "perplexity_after",
                "eval_loss_before",
                "eval_loss_after",
                "train_tokens",
                "tokens_per_s",
                "wall_s",
                "steps",
            )
        } | {"perplexity_drop": drop}
    for precision, r in results.items():
        print(
            f"{precision}: perplexity {r['perplexity_before']:.3f} -> {r['perplexity_after']:.3f} "
            f"({r['perplexity_drop']:.1%} lower), "
            f"eval loss {r['eval_loss_before']:.4f} -> {r['eval_loss_after']:.4f}, "
            f"{r['steps']} steps, {r['train_tokens']:,} tokens at {r['tokens_per_s']:.0f} tok/s, "
            f"wall {r['wall_s']:.0f} s"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
