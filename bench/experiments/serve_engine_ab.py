"""Two builds of the native engine in one process, timed alternately on the same decode load:
the way to compare engine choices on a shared VM whose speed drifts by a third between runs
minutes apart (BENCHMARKS.md section 5). Each arm loads its own copy of the model, builds
its linear layers as the arm says, reads N prompts of 50 tokens and decodes `--warm` steps; then
rounds of `--steps` timed decode steps alternate between the arms.

Arms: `serve` (what `kubetune serve` builds: q/k/v and gate/up fused into one GEMM each,
engine/lora.py; each weight shape timed plain and packed at start-up and packed unless plain is
clearly faster, serve/native/packed.py), `apart` (the same without fusion: one GEMM per projection,
as transformers' modules are), `all` (fused, every shape packed without a race) and `none`
(fused, plain GEMMs).

    .venv/bin/python bench/experiments/serve_engine_ab.py --seqs 16
    .venv/bin/python bench/experiments/serve_engine_ab.py --seqs 64 --arms serve,all,none
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

ARMS = {  # name: (fuse, packing)
    "serve": (True, "race"),
    "apart": (False, "race"),
    "all": (True, "all"),
    "none": (True, "none"),
}


def build(arm: str, seqs: int, adapters: list, rows: int):
    from kubetune.contracts.engine import Limits, Request, Sampling
    from kubetune.engine.core import Engine
    from kubetune.engine.kvcache import SlotCache, register
    from kubetune.models.load import resolve_model
    from kubetune.serve.native.metrics import ServeMetrics
    from kubetune.serve.native.models import load_served
    from kubetune.serve.native.packed import pack

    fuse, packing = ARMS[arm]
    served = load_served(resolve_model("smollm2-135m-instruct"), adapters, torch.float32, register(), fuse=fuse)
    if packing != "none":
        print(f"{arm}: {pack(served.lm, rows, only_faster=packing == 'race')}")
    cache = SlotCache.for_config(served.lm.config, torch.float32, 4 << 30)
    metrics = ServeMetrics(served.base_name, len(adapters), [a.name for a in adapters])
    engine = Engine(served.lm, None, cache, served.lora, Limits(), metrics)
    for i in range(seqs):
        adapter = (i % (len(adapters) + 1)) - 1 if adapters else -1
        engine.submit(Request(f"r{i}", list(range(100, 150)), Sampling(4000), lambda ev: None, adapter))
    engine._take_inbox()
    engine._admit()
    return engine


def main() -> None:
    from kubetune.contracts.serving import Adapter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="serve,apart")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--warm", type=int, default=40, help="untimed decode steps first (cache lengths)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per arm per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=0)
    ap.add_argument("--run", default=None, help="a LoRA run whose adapter is served --adapters times")
    args = ap.parse_args()
    adapters = [Adapter(f"a{i}", args.run) for i in range(args.adapters)] if args.run else []
    arms = args.arms.split(",")
    engines = {arm: build(arm, args.seqs, adapters, min(16, args.seqs)) for arm in arms}
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    with torch.inference_mode():
        for engine in engines.values():
            while any(s.prompt_left for s in engine._slots):
                engine._step()
            for _ in range(args.warm):
                engine._step()
        for _ in range(args.rounds):
            for arm, engine in engines.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    engine._step()
                times[arm].append((time.perf_counter() - t0) / args.steps)
    first = statistics.median(times[arms[0]])
    print(f"{args.seqs} sequences, {len(adapters)} adapters, {torch.get_num_threads()} threads, {args.rounds} rounds:")
    for arm in arms:
        med = statistics.median(times[arm])
        spread = ", ".join(f"{t * 1e3:.0f}" for t in times[arm])
        print(
            f"  {arm:8s} median {med * 1e3:6.1f} ms/step = {args.seqs / med:6.1f} tokens/s "
            f"({first / med:.2f}x {arms[0]}); per round: {spread}"
        )


if __name__ == "__main__":
    main()
