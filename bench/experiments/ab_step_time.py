"""The kubetune arm of bench/train/train_vs_hf.py (its overrides) in one process, to compare two
commits side by side (what BENCHMARKS.md's refactor A/B did). The argument is the tree to
take the bench config from; run it once per tree with that tree's `src` on PYTHONPATH:

    (cd OLD && PYTHONPATH=OLD/src /work/main/.venv/bin/python /work/main/bench/experiments/ab_step_time.py OLD)
    .venv/bin/python bench/experiments/ab_step_time.py .

Prints the loop's tokens/s and the median milliseconds per token over the logged steps.
fp32: on a CPU without bf16 units bf16 is many times slower (see the run's kernels line).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import statistics
import sys
import tempfile
import types
from pathlib import Path


def main(tree: str) -> None:
    from kubetune.training.run import train_from_recipe

    config = Path(tree, "bench", "train", "train_vs_hf.py")
    if not config.exists():  # commits before bench/ was split into folders
        config = Path(tree, "bench", "train_vs_hf.py")
    spec = importlib.util.spec_from_file_location("bench_tvh", config)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = types.SimpleNamespace(rows=48, eval_rows=16, threads=2, batch=8, kt_micro=2)
    with tempfile.TemporaryDirectory() as tmp:
        summary = train_from_recipe(None, [*bench.kubetune_overrides(args, "fp32", tmp, 2, 2), "train.log_every=1"])
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    per_token = [
        (b["elapsed_s"] - a["elapsed_s"]) / (b["tokens"] - a["tokens"]) * 1000 for a, b in itertools.pairwise(records)
    ]
    d = summary if isinstance(summary, dict) else summary.as_dict()  # older commits return a dict
    print(
        json.dumps({"tokens_per_s": d["tokens_per_s"], "median_ms_per_token": round(statistics.median(per_token), 3)})
    )


if __name__ == "__main__":
    main(sys.argv[1])
