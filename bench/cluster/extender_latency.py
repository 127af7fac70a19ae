"""Scheduler extender latency through real HTTP, in both of kube-scheduler's modes, at 100 / 1,000 / 5,000 nodes.

    .venv/bin/python bench/cluster/extender_latency.py            # the figures in BENCHMARKS.md, section 4
    .venv/bin/python bench/cluster/extender_latency.py --quick    # a smoke run (5 rounds per size)

The extender runs as the Deployment runs it: `kubetune scheduler-extender --watch-pods` in its
own process (uvicorn, one worker) on a loopback port, its cache listing and watching an API
server (kmock, in this process) that holds the same nodes and a running pod on every node that
is not all free (holding the cards its `cards-free` annotation says are taken). The client keeps one HTTP/1.1
connection open (as the kube-scheduler does) and makes the scheduler's two calls per pod,
Filter then Prioritize on the nodes Filter kept, in each mode (pkg/scheduler/extender.go):

- `full nodes` (nodeCacheCapable: false): ExtenderArgs with full v1.Node JSON (labels, plugin
  annotations, conditions, images, capacity/allocatable; ~4.2 KB a node); the filter answers
  with the kept nodes' JSON, which is what the scheduler then posts to /prioritize.
- `node names` (nodeCacheCapable: true): ExtenderArgs with NodeNames; the extender reads the
  nodes from its cache.

The two modes are interleaved round by round (their order alternating), so a neighbour's load
falls on both alike. Both must give the same answer (checked). Timed: from sending a request to
having read the whole answer. Printed per size, mode and verb: request and answer size, p50 /
p99 / max, the p99 as a ratio of the 100 ms target, and the machine's load average (other
processes on a small machine move the tail). Not measured: the scheduler's own cost of
encoding and decoding those bodies in Go.
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
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # run from a checkout, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the payloads are the tests' (tests/cluster/samples.py)

from tests.cluster.samples import gaudi_node, training_pod
from tests.kit.kube import KmockServer

from kubetune.netutil import free_port

ROOT = Path(__file__).resolve().parents[2]
TARGET_P99_MS = 100.0
MODES = ("full nodes", "node names")


def make_nodes(n_nodes: int, rng: random.Random) -> list[dict]:
    return [
        gaudi_node(
            f"hls-{i:05d}",
            free=rng.choice([0, 1, 2, 4, 6, 8, 8, 8]),
            leaf=f"leaf-{i // 16:03d}",
            rdma_latency_us=round(rng.uniform(2, 6), 2),
        )
        for i in range(n_nodes)
    ]


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


def args_body(pod: bytes, nodes: list[bytes] | None = None, names: list[str] | None = None) -> bytes:
    """ExtenderArgs as encoding/json writes it: the mode's field set, the other one null."""
    node_list = b"null" if nodes is None else b'{"metadata":{},"items":[' + b",".join(nodes) + b"]}"
    return b'{"Pod":' + pod + b',"Nodes":' + node_list + b',"NodeNames":' + json.dumps(names).encode() + b"}"


class Calls:
    """The four request bodies of one size: each mode's Filter, and its Prioritize of what Filter kept."""

    def __init__(self, conn: http.client.HTTPConnection, pod: dict, nodes: list[dict]):
        pod_json = json.dumps(pod).encode()
        node_json = [json.dumps(n).encode() for n in nodes]
        names = [n["metadata"]["name"] for n in nodes]
        self.filter = {MODES[0]: args_body(pod_json, nodes=node_json), MODES[1]: args_body(pod_json, names=names)}
        full = json.loads(post(conn, "/filter", self.filter[MODES[0]])[1])
        kept = [n["metadata"]["name"] for n in full["Nodes"]["items"]]
        sent = dict(zip(names, nodes))
        if [sent[n["metadata"]["name"]] for n in full["Nodes"]["items"]] != full["Nodes"]["items"]:
            raise SystemExit("the filter did not hand back the nodes it kept as it got them")
        self.kept = kept
        self.prioritize = {
            MODES[0]: args_body(pod_json, nodes=[node_json[names.index(n)] for n in kept]),
            MODES[1]: args_body(pod_json, names=kept),
        }

    def same_answer(self, conn: http.client.HTTPConnection) -> bool:
        """Does the names mode keep the same nodes and give the same scores as the full-nodes mode?"""
        by_name = json.loads(post(conn, "/filter", self.filter[MODES[1]])[1])["NodeNames"]
        scores = [json.loads(post(conn, "/prioritize", self.prioritize[m])[1]) for m in MODES]
        return by_name == self.kept and scores[0] == scores[1]


def busy_pods(nodes: list[dict]) -> list[dict]:
    """A running pod on each node that is not all free, holding the cards its annotation says are taken."""
    pods = []
    for node in nodes:
        meta = node["metadata"]
        cards, free = node["status"]["allocatable"]["habana.ai/gaudi"], meta["annotations"]["kubetune.io/cards-free"]
        taken = int(cards) - int(free)
        if taken > 0:
            pods.append(training_pod(f"busy-{meta['name']}", 0, cards=taken, node_name=meta["name"], phase="Running"))
    return pods


def start_api_server(nodes: list[dict]) -> tuple[KmockServer, Path]:
    """kmock holding the nodes and the pods on them, and a kubeconfig pointing at it."""
    objects = {("v1/nodes", None, n["metadata"]["name"]): n for n in nodes}
    objects.update({("v1/pods", p["metadata"]["namespace"], p["metadata"]["name"]): p for p in busy_pods(nodes)})
    api = KmockServer(("v1/pods",), objects)
    kubeconfig = Path(tempfile.mkdtemp()) / "kubeconfig"
    kubeconfig.write_text(api.kubeconfig("bench"))
    return api, kubeconfig


def start_extender(port: int, kubeconfig: Path, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    env.update(PYTHONPATH=str(ROOT / "src"), KUBECONFIG=str(kubeconfig))
    cmd = [sys.executable, "-m", "kubetune", "scheduler-extender", "--host", "127.0.0.1", "--port", str(port)]
    # its log to a file: the watch retries (and warns) every 2 s once the API server is gone (see main)
    proc = subprocess.Popen([*cmd, "--watch-pods", "--log-level", "warning"], env=env, stderr=log.open("w"))
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


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def wait_until_idle(pid: int, timeout: float = 120) -> None:
    """Until the extender has done the work a list leaves behind (three quiet seconds in a row)."""
    deadline = time.monotonic() + timeout
    quiet, before = 0, cpu_seconds(pid)
    while quiet < 3:
        if time.monotonic() > deadline:
            raise SystemExit("the extender never went idle")
        time.sleep(1.0)
        now = cpu_seconds(pid)
        quiet, before = (quiet + 1 if now - before < 0.03 else 0), now


def measure(conn, pid: int, calls: Calls, rounds: int) -> dict[tuple[str, str], tuple[list[float], float]]:
    """(mode, verb) -> (wall ms of each call, the extender's CPU ms per call on average)."""
    keys = [(m, v) for m in MODES for v in ("filter", "prioritize")]
    wall: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
    cpu = dict.fromkeys(keys, 0.0)
    for i in range(rounds + 3):  # 3 warm-up rounds
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            for verb, bodies in (("filter", calls.filter), ("prioritize", calls.prioritize)):
                before = cpu_seconds(pid)  # clock ticks: coarse per call, fine summed over the rounds
                elapsed = post(conn, f"/{verb}", bodies[mode])[0]
                if i >= 3:
                    wall[mode, verb].append(elapsed)
                    cpu[mode, verb] += cpu_seconds(pid) - before
    return {k: (wall[k], cpu[k] * 1000 / rounds) for k in keys}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,1000,5000")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per size (default: 300 / 200 / 100)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    nodes = make_nodes(max(sizes), random.Random(0))
    pod = training_pod("llama-lora", 1, cards=4, workers=8)
    api, kubeconfig = start_api_server(nodes)
    port = free_port()
    log = kubeconfig.with_name("extender.log")
    proc = start_extender(port, kubeconfig, log)
    rows = []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        calls = {n: Calls(conn, pod, nodes[:n]) for n in sizes}
        deadline = time.monotonic() + 120
        while not all(c.same_answer(conn) for c in calls.values()):  # the cache lists the nodes after it starts
            if time.monotonic() > deadline:
                raise SystemExit("the two modes disagree: the extender's cache never matched the nodes")
            time.sleep(0.5)
        # kmock answers the kubernetes client's `watch=True` with a list and closes it, so the
        # extender would relist every 2 s; a real API server keeps the watch open and quiet.
        # With the API server gone the extender keeps what it listed and retries (cheaply).
        api.stop()
        wait_until_idle(proc.pid)
        load_before = os.getloadavg()
        for n in sizes:
            count = 5 if args.quick else (args.rounds or {100: 300, 1000: 200, 5000: 100}.get(n, 100))
            for (mode, verb), (wall, cpu) in measure(conn, proc.pid, calls[n], count).items():
                request = (calls[n].filter if verb == "filter" else calls[n].prioritize)[mode]
                answer = len(post(conn, f"/{verb}", request)[1])
                rows.append((n, mode, verb, len(request), answer, count, wall, cpu))
        load_after = os.getloadavg()
    finally:
        if proc.poll() is not None:  # it died: say why
            print(log.read_text()[-3000:], file=sys.stderr)
        proc.terminate()
        proc.wait(timeout=10)
    report(rows, sizes, load_before, load_after)
    return 0


def report(rows, sizes, load_before, load_after) -> None:
    print(
        f"{'nodes':>6} {'mode':>11} {'verb':>11} {'sent MB':>8} {'back MB':>8} {'reqs':>5} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99/100ms':>10} {'CPU ms':>7}"
    )
    for n, mode, verb, sent, back, count, wall, cpu in rows:
        p99 = percentile(wall, 99)
        print(
            f"{n:>6} {mode:>11} {verb:>11} {sent / 1e6:>8.3f} {back / 1e6:>8.3f} {count:>5} "
            f"{statistics.median(wall):>8.1f} {p99:>8.1f} {max(wall):>8.1f} {p99 / TARGET_P99_MS:>10.2f} {cpu:>7.1f}"
        )
    print(
        f"load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
        f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} on {os.cpu_count()} CPUs "
        "(CPU ms: the extender's own CPU time per call, mean; less moved by other processes than wall time)"
    )
    biggest = max(sizes)
    for mode in MODES:
        chain = [r for r in rows if r[0] == biggest and r[1] == mode]
        worst = max(percentile(r[6], 99) for r in chain)
        cycle = statistics.median([a + b for a, b in zip(chain[0][6], chain[1][6])])
        print(
            f"{mode} at {biggest} nodes: worst p99 {worst:.1f} ms "
            f"(target < {TARGET_P99_MS:.0f} ms: {'met' if worst < TARGET_P99_MS else 'NOT met'}); "
            f"filter + prioritize: median {cycle:.1f} ms, CPU {chain[0][7] + chain[1][7]:.1f} ms"
        )


if __name__ == "__main__":
    raise SystemExit(main())
