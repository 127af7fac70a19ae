"""The same lm-eval tasks through kubetune's engine backend and lm-eval's own `hf` backend (HFLM),
on the same CPU in one run: seconds per task (model loading apart), the ratio, and both backends'
metrics (they should agree: tests/training/test_lmeval.py holds them to HFLM's on a tiny model).

    .venv/bin/python bench/eval/lmeval_vs_hf.py                                  # flashcards, flashcards_mc, all 32
    .venv/bin/python bench/eval/lmeval_vs_hf.py --limit 4                        # a smoke run
    .venv/bin/python bench/eval/lmeval_vs_hf.py --hf-batch-size 32 --threads 8

The model is the embedded default (SmolLM2-135M-Instruct, kubetune.models.load.resolve_model), in
fp32 for both; prompts through its chat template (lm-eval's --apply_chat_template), as
`kubetune eval --tasks` does for a chat-trained run. The target of issue 38 is kubetune >= 3x.
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def evaluate(lm: Any, task: str, manager: Any, limit: int | None) -> tuple[float, dict[str, float]]:
    from lm_eval import simple_evaluate

    from kubetune.training.lm_tasks import scores

    started = time.perf_counter()
    found = simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit, apply_chat_template=True)
    return time.perf_counter() - started, scores(found)[task]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="embedded name or model directory")
    parser.add_argument("--tasks", default="flashcards,flashcards_mc")
    parser.add_argument("--limit", type=int, default=None, help="the first N examples of each task")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="HFLM's batch size (kubetune sizes its own)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()

    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from kubetune.models.load import resolve_model
    from kubetune.training.lmeval import EngineLM, shipped_tasks

    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    manager = TaskManager(include_path=str(shipped_tasks()))
    t0 = time.perf_counter()
    hf = HFLM(pretrained=source, dtype="float32", batch_size=args.hf_batch_size, device="cpu")
    t1 = time.perf_counter()
    kt = EngineLM(pretrained=source)
    t2 = time.perf_counter()
    print(f"model {source}; {torch.get_num_threads()} threads; load hf {t1 - t0:.1f} s, kubetune {t2 - t1:.1f} s")
    rows = []
    for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        hf_s, hf_scores = evaluate(hf, task, manager, args.limit)
        kt_s, kt_scores = evaluate(kt, task, manager, args.limit)
        rows.append((task, hf_s, kt_s, hf_scores, kt_scores))
    print(f"\n{'task':<16}{'hf s':>10}{'kubetune s':>12}{'ratio':>8}   metrics (hf / kubetune)")
    for task, hf_s, kt_s, hf_scores, kt_scores in rows:
        metrics = ", ".join(f"{m} {hf_scores[m]:.4f}/{kt_scores.get(m, float('nan')):.4f}" for m in hf_scores)
        print(f"{task:<16}{hf_s:>10.2f}{kt_s:>12.2f}{hf_s / kt_s:>7.2f}x   {metrics}")
    total_hf, total_kt = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"{'all':<16}{total_hf:>10.2f}{total_kt:>12.2f}{total_hf / total_kt:>7.2f}x   (target >= 3x)")


if __name__ == "__main__":
    main()
