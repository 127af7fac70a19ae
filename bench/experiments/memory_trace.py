"""Resident memory over a short `kubetune train` run: a sampler of /proc/self/status every
50 ms, printed with the run's log lines and after every step, then the peak.

Run it under each allocator to compare them (what BENCHMARKS.md's "Where the memory goes"
table did; this script runs the engine in-process, so the allocator is whatever the process
started with):

    .venv/bin/python bench/experiments/memory_trace.py                              # glibc malloc
    MALLOC_MMAP_THRESHOLD_=1048576 .venv/bin/python bench/experiments/memory_trace.py  # glibc, large blocks mmap-ed
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 .venv/bin/python bench/experiments/memory_trace.py
    .venv/bin/python bench/experiments/memory_trace.py train.micro_batch_size=2     # any recipe override

The default recipe, `train.max_steps=3`, no checkpoints.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
import time

T0 = time.time()
PEAK = [0]


def rss_mb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    return 0


def sample() -> None:
    while True:
        PEAK[0] = max(PEAK[0], rss_mb())
        time.sleep(0.05)


def say(what: str) -> None:
    print(f"[{time.time() - T0:6.1f} s  rss {rss_mb():,} MB  peak {PEAK[0]:,} MB] {what[:100]}", flush=True)


class ToTrace(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        say(record.getMessage())


def main(overrides: list[str]) -> None:
    import kubetune.training.run as run

    threading.Thread(target=sample, daemon=True).start()
    logging.getLogger("kubetune").addHandler(ToTrace())
    step = run.train_step

    def traced_step(*args, **kwargs):
        result = step(*args, **kwargs)
        say("step done")
        return result

    run.train_step = traced_step
    with tempfile.TemporaryDirectory() as tmp:
        run.train_from_recipe(None, [f"output_dir={tmp}/r", "train.max_steps=3", "train.save_every=0", *overrides])
    print(f"peak RSS {PEAK[0]:,} MB")


if __name__ == "__main__":
    main(sys.argv[1:])
