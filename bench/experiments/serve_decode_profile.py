"""Where a decode step of the native engine spends its time (the profiles quoted in
BENCHMARKS.md section 5): N sequences of 50 prompt tokens, prompts read, then `--steps`
decode steps untimed (so the cache holds realistic lengths), then 8 timed steps and a
torch.profiler table over 5 more. `--adapters K` serves K copies of a run's adapter and
puts base and adapter rows round-robin in the batch (the mixed-adapter step); `--mix-ab`
then also times, in the same process and alternating, decode forwards of the same sequences
as base rows only and as the round-robin mix (the within-15% target of BENCHMARKS.md
section 5, without the noise of two runs).

    .venv/bin/python bench/experiments/serve_decode_profile.py --seqs 64 --steps 60
    .venv/bin/python bench/experiments/serve_decode_profile.py --seqs 16 --adapters 4 --run runs/smollm2-135m-lora-cpu
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    from kubetune.contracts.engine import Limits, Request, Sampling
    from kubetune.contracts.serving import Adapter
    from kubetune.engine.core import Engine
    from kubetune.engine.kvcache import SlotCache, register
    from kubetune.models.load import resolve_model
    from kubetune.serve.native.metrics import ServeMetrics
    from kubetune.serve.native.models import load_served
    from kubetune.serve.native.packed import pack

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=0)
    ap.add_argument("--run", default=None, help="a LoRA run whose adapter is served --adapters times")
    ap.add_argument("--mix-ab", type=int, default=0, help="rounds of base-only vs mixed forwards (needs --adapters)")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    adapters = [Adapter(f"a{i}", args.run) for i in range(args.adapters)] if args.run else []
    served = load_served(resolve_model("smollm2-135m-instruct"), adapters, torch.float32, register())
    print(pack(served.lm, 16))
    cache = SlotCache.for_config(served.lm.config, torch.float32, 4 << 30)
    engine = Engine(served.lm, None, cache, served.lora, Limits(), ServeMetrics(served.base_name, 0, []))
    for i in range(args.seqs):
        adapter = (i % (len(adapters) + 1)) - 1 if adapters else -1
        engine.submit(Request(f"r{i}", list(range(100, 150)), Sampling(1000), lambda ev: None, adapter))
    engine._take_inbox()
    engine._admit()
    with torch.inference_mode():
        while any(s.prompt_left for s in engine._slots):
            engine._step()
        for _ in range(args.steps):
            engine._step()
        t0 = time.perf_counter()
        for _ in range(8):
            engine._step()
        step = (time.perf_counter() - t0) / 8
        print(
            f"{args.seqs} sequences, {len(adapters)} adapters: decode step {step * 1e3:.1f} ms "
            f"= {args.seqs / step:.0f} tokens/s, {torch.get_num_threads()} threads"
        )
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine._step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    if args.mix_ab and adapters:
        mix_ab(engine, args.mix_ab)


def mix_ab(engine, rounds: int) -> None:
    """Median decode forward (with the LM head) of the running sequences as base rows only
    and as their round-robin adapters, alternating."""
    import statistics

    from kubetune.engine.kvcache import Batch
    from kubetune.engine.lora import BASE

    seqs = engine._slots
    ids = torch.tensor([s.tokens[-1] for s in seqs])
    batch = Batch.of([s.cached for s in seqs], [])
    arms = {"base only": [BASE] * len(seqs), "mixed": [s.request.adapter for s in seqs]}
    times: dict[str, list[float]] = {k: [] for k in arms}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, adapters in arms.items():
                t0 = time.perf_counter()
                engine.head(engine._forward(ids, batch, adapters)).argmax(-1)
                times[name].append(time.perf_counter() - t0)
    base, mixed = (statistics.median(times[k]) for k in arms)
    print(
        f"mix A/B over {rounds} rounds: base only {base * 1e3:.1f} ms, mixed {mixed * 1e3:.1f} ms: "
        f"mixed/base throughput {base / mixed:.2f}"
    )


if __name__ == "__main__":
    main()
