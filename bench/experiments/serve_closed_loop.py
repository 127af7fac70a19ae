"""The native engine under a closed loop, in-process (no HTTP, no client processes): what the
engine alone sustains, to tell its own speed from the server's and the load generator's
(BENCHMARKS.md section 5). Built and run on one thread, as `kubetune serve` does.

C clients each submit the next chat prompt (questions of
../shared/data/medical_flashcards/test.jsonl, 128 new tokens, greedy) when their previous one
ends; generated tokens/s and time to first token are printed per window. `--mix` sends
requests round-robin over the base and 4 adapters (copies of `--run`'s adapter).

    .venv/bin/python bench/experiments/serve_closed_loop.py --concurrency 16 --seconds 20 --windows 3
    .venv/bin/python bench/experiments/serve_closed_loop.py --concurrency 16 --mix --run runs/smollm2-135m-lora-cpu
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: bench.common from this checkout

from bench.common.inproc import PROMPTS, chat_prompts, start_engine


def main() -> None:
    from kubetune.contracts.engine import Request, Sampling
    from kubetune.contracts.serving import Adapter
    from kubetune.models.load import resolve_model
    from kubetune.serve.server import ServeOptions

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=20.0, help="per window")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--mix", action="store_true", help="round-robin over the base and 4 adapters (needs --run)")
    ap.add_argument("--run", help="a LoRA run directory whose adapter is served 4 times")
    ap.add_argument("--prompts", default=str(PROMPTS))
    args = ap.parse_args()
    adapters = tuple(Adapter(f"a{i}", args.run) for i in range(1, 5)) if args.mix and args.run else ()
    opts = ServeOptions(target=resolve_model("smollm2-135m-instruct"), adapters=adapters)
    served, engine, summary = start_engine(opts)
    print(summary, flush=True)
    prompts = chat_prompts(served.tokenizer, args.prompts)
    lock = threading.Lock()
    state = {"generated": 0, "next": 0, "stop": False}
    ttft: list[float] = []

    def launch() -> None:
        with lock:
            i = state["next"]
            state["next"] += 1
        sent, first = time.monotonic(), [True]
        adapter = (i % (len(adapters) + 1)) - 1 if adapters else -1

        def sink(ev) -> None:
            if ev.token is not None:
                with lock:
                    state["generated"] += 1
                    if first[0]:
                        ttft.append(time.monotonic() - sent)
                        first[0] = False
            if ev.finish_reason and not state["stop"]:
                launch()

        engine.submit(Request(f"r{i}", prompts[i % len(prompts)], Sampling(args.max_tokens), sink, adapter))

    for _ in range(args.concurrency):
        launch()
    for w in range(args.windows):
        g0, t0, n0 = state["generated"], time.monotonic(), len(ttft)
        time.sleep(args.seconds)
        window = sorted(ttft[n0:])
        rate = (state["generated"] - g0) / (time.monotonic() - t0)
        p50 = window[len(window) // 2] if window else float("nan")
        top = window[-1] if window else float("nan")
        print(f"window {w}: {rate:.1f} tokens/s; TTFT p50 {p50:.2f} s, max {top:.2f} s ({len(window)} first tokens)")
    state["stop"] = True
    engine.stop()


if __name__ == "__main__":
    main()
