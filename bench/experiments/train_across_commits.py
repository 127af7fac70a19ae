"""`kubetune train` on the bench recipe at several commits, interleaved, to find which commit
cost training speed (a bisection by measurement).

Each commit is checked out once as a git worktree; every round runs each commit's
`python -m kubetune train` (the CLI as typed, so every start-up choice of that commit is
made: processes, precision, compile) in turn, rotating the order between rounds so that no
commit always runs first or last. Each run starts from an empty kubetune cache (the
converted model is shared, nothing else), so no commit inherits another's cached decisions:
what each run measures is what a first start of that commit does on this machine.

    .venv/bin/python bench/experiments/train_across_commits.py 50cd74e a6cbb58 HEAD --rounds 2
    .venv/bin/python bench/experiments/train_across_commits.py 50cd74e HEAD -- \
        --nproc-per-node 2 train.micro_batch_size=1

Arguments after `--` are passed to every `kubetune train` (key=value ones after the bench's own,
so they override them). Prints one JSON line per run and a
table of medians: loop tokens/s, wall seconds, and the commit's own log lines about its
choices (processes, kernels, compile). Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data" / "medical_flashcards"
CHOICE_WORDS = ("processes:", "kernels:", "compile:", "allocator")


def bench_overrides(rows: int, eval_rows: int) -> list[str]:
    """bench/train/train_vs_hf.py's kubetune arm, as typed (no thread count: the probe decides)."""
    return [
        f"data.train={SHARED / 'train.jsonl'}",
        f"data.eval={SHARED / 'test.jsonl'}",
        f"data.max_train_samples={rows}",
        f"eval.max_samples={eval_rows}",
        "eval.generate=0",
        "eval.batch_size=8",
        "lora.r=8",
        "lora.alpha=16",
        "lora.dropout=0.05",
        "lora.target_modules=[q_proj,v_proj]",
        "train.epochs=1",
        "train.micro_batch_size=2",
        "train.grad_accum=1",
        "train.lr=2e-4",
        "train.lr_schedule=cosine",
        "train.warmup_steps=5",
        "train.precision=auto",
        "train.seed=42",
        "train.save_every=0",
        "train.log_every=1000",
    ]


def worktree(commit: str, root: Path) -> tuple[str, Path]:
    sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=REPO, text=True, capture_output=True, check=True)
    short = sha.stdout.strip()
    path = root / short
    if not path.exists():
        add = ["git", "worktree", "add", "--detach", str(path), short]
        subprocess.run(add, cwd=REPO, check=True, capture_output=True)
    return short, path


def fresh_cache(root: Path) -> Path:
    """An empty kubetune cache that shares only the converted model (converting costs ~20 s)."""
    cache = Path(tempfile.mkdtemp(dir=root, prefix="cache-"))
    models = Path(os.environ.get("KUBETUNE_CACHE", Path.home() / ".cache" / "kubetune")) / "models"
    if models.exists():
        (cache / "models").symlink_to(models)
    return cache


def run_once(short: str, tree: Path, root: Path, args: argparse.Namespace) -> dict:
    cache = fresh_cache(root)
    out = cache / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LD_PRELOAD")}
    env.update(PYTHONPATH=str(tree / "src"), KUBETUNE_CACHE=str(cache), HF_HUB_OFFLINE="1")
    options = [a for a in args.extra if "=" not in a or a.startswith("-")]
    later = [a for a in args.extra if a not in options]  # key=value after the bench's own, so they win
    cmd = [sys.executable, "-m", "kubetune", "train", *options, *bench_overrides(args.rows, args.eval_rows), *later]
    cmd.append(f"output_dir={out}")
    cmd.append(f"data.cache_dir={cache / 'data'}")
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    wall = time.perf_counter() - start
    shutil.rmtree(cache / "data", ignore_errors=True)
    if res.returncode != 0:
        return {"commit": short, "failed": res.stderr.strip()[-600:]}
    summary = json.loads((out / "summary.json").read_text())
    choices = [ln.split("kubetune: ", 1)[-1] for ln in res.stderr.splitlines() if any(w in ln for w in CHOICE_WORDS)]
    return {
        "commit": short,
        "tokens_per_s": summary["tokens_per_s"],
        "train_s": summary["train_time_s"],
        "wall_s": round(wall, 1),
        "tokens": summary["train_tokens"],
        "choices": choices,
    }


def report(results: list[dict], order: list[str]) -> None:
    print(f"\n{'commit':<10} {'runs':>4} {'tokens/s (median)':>18} {'train s':>8} {'wall s':>8}  x first")
    first = None
    for short in order:
        ok = [r for r in results if r["commit"] == short and "tokens_per_s" in r]
        if not ok:
            print(f"{short:<10} failed")
            continue
        tps = statistics.median(r["tokens_per_s"] for r in ok)
        first = first or tps
        train = statistics.median(r["train_s"] for r in ok)
        wall = statistics.median(r["wall_s"] for r in ok)
        print(f"{short:<10} {len(ok):>4} {tps:>18.1f} {train:>8.1f} {wall:>8.1f}  {tps / first:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("commits", nargs="+")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rows", type=int, default=160, help="training rows (train_vs_hf's default)")
    p.add_argument("--eval-rows", type=int, default=8, help="eval is not timed; few rows keep the run short")
    p.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "kubetune-bisect")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.extra = argv[cut + 1 :]  # after --: arguments for every kubetune train
    args.root.mkdir(parents=True, exist_ok=True)
    trees = [worktree(c, args.root) for c in args.commits]
    order = [short for short, _ in trees]
    results = []
    for round_no in range(args.rounds):
        shift = round_no % len(trees)
        for short, tree in trees[shift:] + trees[:shift]:
            result = run_once(short, tree, args.root, args) | {"round": round_no}
            print(json.dumps(result), flush=True)
            results.append(result)
    report(results, order)


if __name__ == "__main__":
    main()
