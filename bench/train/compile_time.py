"""Time to the first training step, with and without `train.compile`, cold and warm.

Each arm is a fresh `kubetune train` process on the embedded default (precision as the
probe chooses); the time is from the process's start until its first step is in
metrics.jsonl (model load, kernel probe and the eval before training are off or cached:
`eval.max_samples=1`). "cold" runs with an empty inductor cache, "warm" with the cache the
cold run left, as a rerun or a restarted pod with the kubetune cache on a volume would.
The steady step time after compiling is printed too, so the compile's payback is visible.

    .venv/bin/python bench/train/compile_time.py [--steps 6]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def first_step_s(out: Path, env: dict[str, str], compile_: bool, steps: int) -> tuple[float, float]:
    """(seconds to the first logged step, median seconds per later step)."""
    cmd = [
        sys.executable,
        "-m",
        "kubetune",
        "train",
        f"output_dir={out}",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.save_every=0",
        "eval.max_samples=1",
        "eval.generate=0",
        f"train.compile={'true' if compile_ else 'false'}",
    ]
    metrics = out / "metrics.jsonl"
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = None
    while proc.poll() is None:
        if first is None and metrics.exists() and metrics.read_text().strip():
            first = time.monotonic() - t0
        time.sleep(0.1)
    if proc.returncode != 0:
        raise SystemExit(f"kubetune train failed ({proc.returncode}): {' '.join(cmd)}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    first = first if first is not None else time.monotonic() - t0
    gaps = sorted(b["elapsed_s"] - a["elapsed_s"] for a, b in itertools.pairwise(records[1:]))  # after the first
    return first, gaps[len(gaps) // 2] if gaps else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor"}  # a fresh cache: cold
        rows = []
        for label, compile_ in (("eager", False), ("compile, cold", True), ("compile, warm", True), ("eager", False)):
            first, step = first_step_s(Path(tmp) / f"run{len(rows)}", env, compile_, args.steps)
            rows.append((label, first, step))
            print(f"{label:15s} first step after {first:6.1f} s; then {step:5.2f} s per step", flush=True)
    eager_first = min(r[1] for r in rows if r[0] == "eager")
    for label, first, _ in rows[1:3]:
        print(f"{label}: {first - eager_first:+.1f} s to the first step vs eager")


if __name__ == "__main__":
    main()
