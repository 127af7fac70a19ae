"""Scheduler extender latency through real HTTP, at 100 / 1,000 / 5,000 nodes per request.

    .venv/bin/python bench/cluster/extender_latency.py            # the figures in bench/results/cluster.md
    .venv/bin/python bench/cluster/extender_latency.py --quick    # a smoke run (5 requests per size)

The extender runs as the Deployment runs it: `kubetune scheduler-extender` in its own
process (uvicorn, one worker), on a loopback port. The client keeps one HTTP/1.1
connection open (as the kube-scheduler does) and posts ExtenderArgs with full v1.Node JSON
(labels, plugin annotations, conditions, images, capacity/allocatable; ~4.2 KB a node) as
the scheduler sends them with nodeCacheCapable: false. Timed: from sending the request to
having read the whole answer. Printed: body size, p50 / p99 / max per verb, and p99 as a
ratio of the 100 ms target and of the scheduler's 5 s httpTimeout, and the machine's load
average (other processes on a small machine move the tail).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # run from a checkout, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the payloads are the tests' (tests/cluster/samples.py)

from tests.cluster.samples import extender_args, gaudi_node, training_pod

from kubetune.netutil import free_port

ROOT = Path(__file__).resolve().parents[2]

TARGET_P99_MS = 100.0


def payload(n_nodes: int, rng: random.Random) -> bytes:
    nodes = [
        gaudi_node(
            f"hls-{i:05d}",
            free=rng.choice([0, 1, 2, 4, 6, 8, 8, 8]),
            leaf=f"leaf-{i // 16:03d}",
            rdma_latency_us=round(rng.uniform(2, 6), 2),
        )
        for i in range(n_nodes)
    ]
    return json.dumps(extender_args(training_pod("llama-lora", 1, cards=4, workers=8), nodes)).encode()


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of 40 samples is the largest but none)."""
    s = sorted(samples)
    rank = max(1, -(-len(s) * q // 100))  # ceil(n * q / 100)
    return s[int(rank) - 1]


def post(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[float, bytes]:
    start = time.perf_counter()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    elapsed = (time.perf_counter() - start) * 1000
    if resp.status != 200:
        raise SystemExit(f"{path}: HTTP {resp.status}: {data[:200]!r}")
    return elapsed, data


def start_extender(port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [
        sys.executable,
        "-m",
        "kubetune",
        "scheduler-extender",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", "/healthz")
            if c.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the extender did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,1000,5000")
    ap.add_argument("--requests", type=int, default=0, help="requests per size and verb (default: 300 / 200 / 100)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    load_before = os.getloadavg()
    default_requests = {100: 300, 1000: 200, 5000: 100}
    rng = random.Random(0)
    port = free_port()
    proc = start_extender(port)
    rows = []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for n in sizes:
            body = payload(n, rng)
            count = 5 if args.quick else (args.requests or default_requests.get(n, 100))
            for verb in ("filter", "prioritize"):
                for _ in range(3):  # warm-up
                    post(conn, f"/{verb}", body)
                t = [post(conn, f"/{verb}", body)[0] for _ in range(count)]
                rows.append((n, len(body), verb, count, statistics.median(t), percentile(t, 99), max(t)))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    print(
        f"{'nodes':>6} {'body MB':>8} {'verb':>11} {'reqs':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'p99/100ms':>10} {'p99/5s':>8}"
    )
    for n, size, verb, count, p50, p99, mx in rows:
        print(
            f"{n:>6} {size / 1e6:>8.2f} {verb:>11} {count:>5} {p50:>8.1f} {p99:>8.1f} {mx:>8.1f} "
            f"{p99 / TARGET_P99_MS:>10.2f} {p99 / 5000:>8.3f}"
        )
    load_after = os.getloadavg()
    print(
        f"load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
        f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} on {os.cpu_count()} CPUs"
    )
    worst = max(r[5] for r in rows if r[0] == max(sizes))
    print(
        f"\nworst p99 at {max(sizes)} nodes: {worst:.1f} ms "
        f"(target < {TARGET_P99_MS:.0f} ms: {'met' if worst < TARGET_P99_MS else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
