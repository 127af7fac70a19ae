"""Time to first token of a burst: N chat prompts submitted to the native engine at once,
in-process (no HTTP), as at the start of each level of `serve_load.py` (BENCHMARKS.md
section 5). Prints each burst's prompt tokens, its slowest and median first token and the
prompt tokens it took from the prefix cache. `--cold` empties the prefix cache before
each burst, so the template's header is not known yet (a new system prompt, or the first
burst after a start). `--profile` prints the torch profiler's table (by op, then by op and
shapes) over the last burst's first engine turn (with the header known, a burst of 16 chat
prompts is read in one turn). Built and run on one thread, as `kubetune serve` does.

    .venv/bin/python bench/experiments/serve_burst.py --size 16 --bursts 5 --cold
    # the same engine before a change, side by side:
    git archive COMMIT src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src .venv/bin/python bench/experiments/serve_burst.py --cold
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: bench.common from this checkout

from bench.common.inproc import PROMPTS, chat_prompts, start_engine


def main() -> None:
    from kubetune.models.load import resolve_model
    from kubetune.serve.server import ServeOptions

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=16, help="requests per burst")
    ap.add_argument("--bursts", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="empty the prefix cache before each burst")
    ap.add_argument("--profile", action="store_true", help="profile the last burst's first turn")
    ap.add_argument("--prompts", default=str(PROMPTS))
    args = ap.parse_args()
    served, engine, summary = start_engine(ServeOptions(target=resolve_model("smollm2-135m-instruct")))
    print(summary, flush=True)
    prompts = chat_prompts(served.tokenizer, args.prompts)
    _burst(engine, [prompts[0]])  # a first request: warms the engine (and the prefix cache, unless --cold)
    profiled: list = []
    for b in range(args.bursts):
        if args.cold:
            engine.prefixes.blocks.clear()
        burst = prompts[1 + b * args.size : 1 + (b + 1) * args.size]
        hits = engine.prefixes.hits
        if args.profile and b == args.bursts - 1:
            profiled = _profile_turns(engine)
        ttft = _burst(engine, burst)
        print(
            f"burst {b}: {sum(map(len, burst))} prompt tokens, first token max {max(ttft):.3f} s, "
            f"median {statistics.median(ttft):.3f} s; {engine.prefixes.hits - hits} "
            "prompt tokens from the prefix cache",
            flush=True,
        )
    deadline = time.monotonic() + 10  # the turn's events reach us before its profiler stops
    while args.profile and not profiled and time.monotonic() < deadline:
        time.sleep(0.05)
    if profiled:
        for group in (False, True):
            table = profiled[0].key_averages(group_by_input_shape=group)
            print(table.table(sort_by="self_cpu_time_total", row_limit=15))
    engine.stop()


def _profile_turns(engine) -> list:
    """The next engine turn that does work runs under the torch profiler, on the engine's thread
    (where its ops run); the list receives the profiler once it has."""
    import torch

    done: list = []
    step = engine._step

    def profiled() -> bool:
        if done:
            return step()
        with torch.profiler.profile(record_shapes=True) as prof:
            did = step()
        if did:
            done.append(prof)
        return did

    engine._step = profiled
    return done


def _burst(engine, prompts: list[list[int]]) -> list[float]:
    """Submit every prompt at once (one new token each); seconds to each one's first token."""
    from kubetune.contracts.engine import Request, Sampling

    done = [threading.Event() for _ in prompts]
    ttft = [0.0] * len(prompts)
    start = time.monotonic()
    for i, prompt in enumerate(prompts):

        def sink(ev, i=i) -> None:
            if ev.token is not None:
                ttft[i] = time.monotonic() - start
            if ev.finish_reason:
                done[i].set()

        engine.submit(Request(f"burst{i}", prompt, Sampling(1), sink))
    for event in done:
        event.wait()
    return ttft


if __name__ == "__main__":
    main()
