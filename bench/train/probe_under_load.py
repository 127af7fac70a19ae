"""Does the start-up precision probe choose the same on a busy machine as on an idle one?

Each start is a fresh process with a fresh kubetune cache that runs the probe training runs
(`kubetune.models.kernels.choose("auto", ...)` on SmolLM2-135M's projection shapes, with the
threads training would use). Load conditions, each with its own starts:

- idle: nothing else runs;
- steady: one neighbour process keeps one core busy with matmuls;
- bursts: two neighbours alternate random bursts of matmuls (5-80 ms) and pauses on both cores;
- saturated: two neighbours keep both cores busy.

Then, once more idle, a fair reference timing: both dtypes warmed, interleaved, median of 25,
on [512 x 576] @ [576 x 1536] plus both backward matmuls (the issue's own method), so that
each choice can be checked against what is really faster here.

    .venv/bin/python bench/train/probe_under_load.py              # 5 starts per condition
    .venv/bin/python bench/train/probe_under_load.py --starts 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter

PROBE = """
import json, os, time, torch
from kubetune.models import kernels
torch.set_num_threads(os.cpu_count())
t = time.perf_counter()
plan = kernels.choose("auto", "fp32", kernels.ModelShapes(576, 1536, 9, 64), torch.device("cpu"))
print(json.dumps({"precision": plan.precision, "evidence": plan.evidence[0], "s": time.perf_counter() - t}))
"""

NEIGHBOUR = """
import random, sys, time, torch
torch.set_num_threads(1)
a = torch.randn(512, 512)
bursts = sys.argv[1] == "bursts"
while True:
    end = time.perf_counter() + (random.uniform(0.005, 0.08) if bursts else 3600)
    while time.perf_counter() < end:
        a @ a
    if bursts:
        time.sleep(random.uniform(0.005, 0.08))
"""

REFERENCE = """
import json, os, statistics, time, torch
torch.set_num_threads(os.cpu_count())
def pair(dt):
    g = torch.Generator().manual_seed(0)
    x, w, gr = (torch.randn(*s, generator=g).to(dt) for s in ((512, 576), (576, 1536), (512, 1536)))
    return lambda: (x @ w, gr @ w.t(), x.t() @ gr)
f, b = pair(torch.float32), pair(torch.bfloat16)
for fn in (f, b):
    for _ in range(3):
        fn()
tf, tb = [], []
for _ in range(25):
    t = time.perf_counter(); f(); tf.append(time.perf_counter() - t)
    t = time.perf_counter(); b(); tb.append(time.perf_counter() - t)
print(json.dumps({"fp32_ms": 1e3 * statistics.median(tf), "bf16_ms": 1e3 * statistics.median(tb)}))
"""

CONDITIONS = {"idle": [], "steady": ["steady"], "bursts": ["bursts", "bursts"], "saturated": ["steady", "steady"]}


def one_start() -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "KUBETUNE_CACHE": cache}
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--starts", type=int, default=5, help="fresh starts per load condition")
    args = p.parse_args()
    from kubetune.models.measure import cpu_flags, cpu_model

    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; flags: {' '.join(flags)}")
    summary = {}
    for name, neighbours in CONDITIONS.items():
        procs = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR, kind]) for kind in neighbours]
        try:
            starts = [one_start() for _ in range(args.starts)]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        counts = Counter(s["precision"] for s in starts)
        summary[name] = dict(counts)
        print(
            f"{name:9s} {dict(counts)}  (probe {min(s['s'] for s in starts):.1f}-{max(s['s'] for s in starts):.1f} s)"
        )
        for s in starts:
            print(f"          {s['precision']}: {s['evidence']}")
    ref = json.loads(subprocess.run([sys.executable, "-c", REFERENCE], capture_output=True, text=True).stdout)
    faster = "bf16" if ref["bf16_ms"] < ref["fp32_ms"] else "fp32"
    ratio = ref["fp32_ms"] / ref["bf16_ms"]
    print(
        f"fair reference (idle, median of 25 interleaved): fp32 {ref['fp32_ms']:.1f} ms, bf16 {ref['bf16_ms']:.1f} ms "
        f"per matmul triple: {faster} is faster (bf16 speed {ratio:.2f}x fp32's)"
    )
    print(json.dumps({"choices": summary, "reference": ref}))


if __name__ == "__main__":
    main()
