"""Why the server runs its engine loop on the thread that loaded the model (BENCHMARKS.md
section 5): the same decode step of 16 sequences, timed where torch's OpenMP runtime has one
pool of workers and where it has two.

torch's CPU wheels use libgomp, which keeps a pool per thread that ever ran a parallel op.
When the pools together hold more threads than there are cores, libgomp stops spinning
between parallel regions (its "throttled" spin count), so every op pays for waking its
workers. Each mode runs in a fresh process:

    .venv/bin/python bench/experiments/serve_omp_pools.py            # all four modes, one after another
    .venv/bin/python bench/experiments/serve_omp_pools.py --mode build-main-run-thread

- main: load and decode on the main thread (one pool);
- same-thread: load and decode on one new thread (one pool: what `kubetune serve` does);
- build-thread-then-run-thread: load on a thread that exits, decode on another (its pool goes with it);
- build-main-run-thread: load on the main thread, decode on a new thread (two pools: the old server).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import torch

MODES = ("main", "same-thread", "build-thread-then-run-thread", "build-main-run-thread")


def build(box: dict) -> None:
    from kubetune.contracts.engine import Limits, Request, Sampling
    from kubetune.engine.core import Engine
    from kubetune.engine.kvcache import SlotCache, register
    from kubetune.models.load import resolve_model
    from kubetune.serve.native.metrics import ServeMetrics
    from kubetune.serve.native.models import load_served
    from kubetune.serve.native.packed import pack

    served = load_served(resolve_model("smollm2-135m-instruct"), [], torch.float32, register())
    pack(served.lm, 16)
    cache = SlotCache.for_config(served.lm.config, torch.float32, 4 << 30)
    engine = Engine(served.lm, None, cache, served.lora, Limits(), ServeMetrics(served.base_name, 0, []))
    for i in range(16):
        engine.submit(Request(f"r{i}", list(range(100, 150)), Sampling(1000), lambda ev: None))
    engine._take_inbox()
    engine._admit()
    box["engine"] = engine


def decode(box: dict, mode: str, steps: int) -> None:
    engine = box["engine"]
    with torch.inference_mode():
        while any(s.prompt_left for s in engine._slots):
            engine._step()
        engine._step()
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(steps):
                engine._step()
            print(f"{mode}: {(time.perf_counter() - t0) / steps * 1e3:.1f} ms per decode step of 16 rows", flush=True)


def run_mode(mode: str, steps: int) -> None:
    box: dict = {}
    if mode == "main":
        build(box)
        decode(box, mode, steps)
        return
    if mode == "same-thread":
        threads = [threading.Thread(target=lambda: (build(box), decode(box, mode, steps)))]
    elif mode == "build-thread-then-run-thread":
        loader = threading.Thread(target=build, args=(box,))
        loader.start()
        loader.join()
        threads = [threading.Thread(target=decode, args=(box, mode, steps))]
    else:
        build(box)
        threads = [threading.Thread(target=decode, args=(box, mode, steps))]
    for t in threads:
        t.start()
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=MODES, help="one mode in this process (default: each in its own)")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if args.mode:
        run_mode(args.mode, args.steps)
        return
    for mode in MODES:
        subprocess.run([sys.executable, __file__, "--mode", mode, "--steps", str(args.steps)], check=True)


if __name__ == "__main__":
    main()
