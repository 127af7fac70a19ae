"""Builds of `kubetune serve` side by side: one server per source tree, all up at once, levels
of C closed-loop clients alternating between them (ABBA) for a number of rounds; prints
generated tokens/s per round and the median per build (BENCHMARKS.md section 5: is a build
slower than another, on a VM whose speed drifts by a third within minutes?).

    for c in ef7a632 6f3535a 4c653ee; do mkdir -p /tmp/b-$c && git archive $c src | tar -x -C /tmp/b-$c; done
    .venv/bin/python bench/experiments/serve_ab_builds.py --concurrency 16 --rounds 4 \
        /tmp/b-ef7a632/src /tmp/b-6f3535a/src /tmp/b-4c653ee/src
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: bench.common from this checkout

from bench.common import serving as sl

from kubetune.netutil import free_port


def main() -> None:
    from kubetune.models.load import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", help="src directories, one per build (PYTHONPATH of its server)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per level")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    model = str(resolve_model("smollm2-135m-instruct"))
    prompts = sl.load_prompts(Path(sl.PROMPTS))
    logs = Path(tempfile.mkdtemp(prefix="serve_ab_builds-"))
    servers: dict[str, tuple[sl.Server, str]] = {}
    try:
        for src in args.sources:
            name = Path(src).parent.name  # /tmp/b-<commit>/src -> b-<commit>
            port = free_port()
            env = dict(os.environ, PYTHONPATH=src, HF_HUB_OFFLINE="1")
            argv = [sys.executable, "-m", "kubetune", "serve", model, "--engine", "native", "--port", str(port)]
            server = sl.Server(name, argv, env, logs / f"{name}.log", port)
            why = server.wait_ready("/ready", 300)
            if why:
                raise SystemExit(f"{name}: {why}")
            base = server.models()[0]["id"]
            asyncio.run(sl.run_level(server.base_url, [base], prompts, args.concurrency, args.max_tokens, None, 10))
            servers[name] = (server, base)
        rates: dict[str, list[float]] = {n: [] for n in servers}
        for r in range(args.rounds):
            for name in list(servers) if r % 2 == 0 else list(servers)[::-1]:
                server, base = servers[name]
                c, n = args.concurrency, args.max_tokens
                level = asyncio.run(sl.run_level(server.base_url, [base], prompts, c, n, None, args.duration))
                rates[name].append(level["tokens_per_s"])
                print(f"{name} round {r + 1}: {level['tokens_per_s']:.1f} tokens/s", flush=True)
    finally:
        for server, _ in servers.values():
            server.stop()
    for name, values in rates.items():
        print(f"{name}: {' / '.join(f'{v:.1f}' for v in values)}; median {statistics.median(values):.1f}")


if __name__ == "__main__":
    main()
