"""`kubetune netprobe`: measure latency between nodes and publish it on this node's Node object.

The scheduler extender's `rdma` score reads `kubetune.io/rdma-latency-us`; this is what writes
it. One prober runs on each node (a DaemonSet on the pod network, rendered with the other
components). Each prober

- answers probes: a TCP echo server on `--port` (and, with RDMA, an `ib_write_lat` server);
- measures, every `--interval` seconds, the one-way latency to up to `--max-peers` other
  probers (the pods of its own DaemonSet, listed through the API, or `--peer` addresses):
  `ib_write_lat`'s typical latency where perftest and an RDMA device are present, else half
  the median TCP round trip of `--samples` small ping-pongs on one connection (TCP_NODELAY);
- annotates its Node with the median over the peers that answered (`kubetune.io/rdma-latency-us`,
  microseconds), the method (`kubetune.io/latency-method`: rdma | tcp) and how many peers
  answered (`kubetune.io/latency-peers`: `answered/asked`). No peer answering removes the latency
  (the extender then scores the node neutrally rather than on a stale figure).

Standard library and `KubeClient` at module level; the kubernetes library only where the API is used.
"""

from __future__ import annotations

import logging
import random
import shutil
import socket
import socketserver
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from kubetune.cluster import nodefacts as keys
from kubetune.errors import UserError
from kubetune.kubeapi import KubeClient

log = logging.getLogger(__name__)

DEFAULT_PORT = 7471
RDMA_PORT = 18515  # perftest's default port for its TCP handshake
_PING = b"kubetune"  # 8 bytes: small enough to measure latency, not bandwidth


# ------------------------------------------------------------------------------ TCP


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := self.request.recv(64):
            self.request.sendall(data)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class EchoServer:
    """What peers measure against: echoes every byte back at once."""

    def __init__(self, host: str = "0.0.0.0", port: int = DEFAULT_PORT):
        try:
            self._server = _Server((host, port), _Echo)
        except OSError as e:
            raise UserError(f"--listen {host} --port {port}: cannot listen there ({e.strerror})") from None
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="netprobe-echo", daemon=True)

    def start(self) -> EchoServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def tcp_latency_us(host: str, port: int, samples: int = 20, timeout: float = 1.0) -> float | None:
    """Half the median round trip of `samples` ping-pongs on one connection, in µs; None if no answer."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _ping(conn)  # warm-up: the first exchange pays for slow start and cold caches
            rtts = [_ping(conn) for _ in range(samples)]
    except OSError:
        return None
    return statistics.median(rtts) / 2 / 1000


def _ping(conn: socket.socket) -> int:
    start = time.perf_counter_ns()
    conn.sendall(_PING)
    got = b""
    while len(got) < len(_PING):
        chunk = conn.recv(len(_PING) - len(got))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        got += chunk
    return time.perf_counter_ns() - start


# ------------------------------------------------------------------------------ RDMA (perftest)


def rdma_available(sysfs_root: Path = Path("/sys")) -> bool:
    """perftest's ib_write_lat on PATH and at least one RDMA device in this container."""
    devices = sysfs_root / "class" / "infiniband"
    return shutil.which("ib_write_lat") is not None and devices.is_dir() and any(devices.iterdir())


def parse_perftest_latency(output: str) -> float | None:
    """ib_write_lat's `t_typical[usec]` (one-way latency) from its report, None if there is no report."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if "t_typical[usec]" not in line:
            continue
        column = line.split().index("t_typical[usec]")
        for row in lines[i + 1 :]:  # warnings ("Conflicting CPU frequency ...") may come first
            fields = row.split()
            if len(fields) > column and fields[0].isdigit():
                try:
                    return float(fields[column])
                except ValueError:
                    return None
    return None


def rdma_latency_us(host: str, port: int = RDMA_PORT, timeout: float = 10.0) -> float | None:
    """Run `ib_write_lat` against a peer's server; None when it fails (busy, unreachable, no RDMA path)."""
    try:
        done = subprocess.run(
            ["ib_write_lat", "-F", "-p", str(port), "-n", "1000", host],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_perftest_latency(done.stdout) if done.returncode == 0 else None


class RdmaServer:
    """`ib_write_lat` in server mode, started again after each client (perftest serves one at a time)."""

    def __init__(self, port: int = RDMA_PORT):
        self.port = port
        self._stop = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread = threading.Thread(target=self._run, name="netprobe-rdma", daemon=True)

    def start(self) -> RdmaServer:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self._proc = subprocess.Popen(
                ["ib_write_lat", "-F", "-p", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            self._proc.wait()
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()


# ------------------------------------------------------------------------------ peers


@dataclass(frozen=True)
class Peer:
    name: str  # the peer's node (or the address given with --peer)
    host: str
    port: int


def parse_peer(text: str, default_port: int) -> Peer:
    """`HOST` or `HOST:PORT` (--peer); more than one colon is a bare IPv6 address."""
    if text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = int(port_text) if port_text.isdigit() else -1
    else:
        host, port = text, default_port
    if not host or not 0 < port < 65536:
        raise UserError(f"--peer {text!r}: use HOST or HOST:PORT, e.g. 10.0.3.7:{default_port}")
    return Peer(text, host, port)


def peers_from_pods(pods: list[dict], own_node: str | None, selector: dict[str, str], port: int) -> list[Peer]:
    """The running probers on other nodes, from v1.Pod JSON (labels are matched here too)."""
    peers = []
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        status, spec = pod.get("status") or {}, pod.get("spec") or {}
        node, ip = spec.get("nodeName"), status.get("podIP")
        if any(labels.get(k) != v for k, v in selector.items()) or status.get("phase") != "Running":
            continue
        if node and ip and node != own_node:
            peers.append(Peer(node, ip, port))
    return sorted(peers, key=lambda p: p.name)


def parse_selector(text: str) -> dict[str, str]:
    pairs = [part.partition("=") for part in filter(None, (p.strip() for p in text.split(",")))]
    if not pairs or any(not k or not sep for k, sep, _ in pairs):
        raise UserError(
            f"--selector {text!r}: use KEY=VALUE[,KEY=VALUE], e.g. app.kubernetes.io/name=kubetune-netprobe"
        )
    return {k: v for k, _, v in pairs}


# ------------------------------------------------------------------------------ one round


@dataclass(frozen=True)
class Round:
    method: str  # rdma | tcp
    latencies: dict[str, float | None]  # peer name -> one-way µs, None = no answer

    @property
    def latency_us(self) -> float | None:
        answered = [v for v in self.latencies.values() if v is not None]
        return statistics.median(answered) if answered else None

    def annotations(self) -> dict[str, str | None]:
        """What goes on the Node (None deletes a key in a merge patch)."""
        answered = sum(v is not None for v in self.latencies.values())
        latency = self.latency_us
        return {
            keys.RDMA_LATENCY_US: None if latency is None else f"{latency:.2f}",
            keys.LATENCY_METHOD: self.method,
            keys.LATENCY_PEERS: f"{answered}/{len(self.latencies)}",
        }

    def as_json(self) -> dict:
        return {"method": self.method, "latency_us": self.latency_us, "peers": self.latencies}


def measure(peers: list[Peer], rdma: bool, samples: int, timeout: float) -> Round:
    """One latency per peer: RDMA where it works (TCP for a peer whose RDMA run failed), else TCP."""
    latencies: dict[str, float | None] = {}
    methods = set()
    for peer in peers:
        value = rdma_latency_us(peer.host, timeout=10 * timeout) if rdma else None
        methods.add("rdma" if value is not None else "tcp")
        if value is None:
            value = tcp_latency_us(peer.host, peer.port, samples, timeout)
        latencies[peer.name] = value
    return Round("rdma" if methods == {"rdma"} else "tcp", latencies)


def worth_publishing(new: Round, last: Round | None, tolerance: float = 0.1) -> bool:
    """A patch per node per round would load the API server of a large cluster for noise: only
    a new method, a different peer count or a latency that moved by more than `tolerance`."""
    if last is None or new.annotations()[keys.LATENCY_PEERS] != last.annotations()[keys.LATENCY_PEERS]:
        return True
    if new.method != last.method or (new.latency_us is None) != (last.latency_us is None):
        return True
    if new.latency_us is None or last.latency_us is None:
        return False
    return abs(new.latency_us - last.latency_us) > tolerance * last.latency_us


# ------------------------------------------------------------------------------ the prober


class Prober:
    """Every `interval` seconds: find peers, measure, annotate the Node when the figure moved."""

    def __init__(
        self,
        node_name: str | None,
        static_peers: list[Peer],
        namespace: str | None,
        selector: dict[str, str],
        port: int,
        rdma: bool = False,
        samples: int = 20,
        timeout: float = 1.0,
        max_peers: int = 16,
        annotate: bool = True,
        kube: KubeClient | None = None,
    ):
        self.node_name = node_name
        self.static_peers = static_peers
        self.namespace = namespace
        self.selector = selector
        self.port = port
        self.rdma = rdma
        self.samples = samples
        self.timeout = timeout
        self.max_peers = max_peers
        self.annotate = annotate
        self._kube = kube
        self._last: Round | None = None
        self._stop = threading.Event()

    @property
    def kube(self) -> KubeClient:
        if self._kube is None:  # connected at first use: `--once` with static peers and no annotation needs no API
            self._kube = KubeClient()
        return self._kube

    def peers(self) -> list[Peer]:
        if self.static_peers:
            return self.static_peers
        pods = self.kube.list("v1", "Pod", self.namespace, labels=self.selector)
        return peers_from_pods(pods, self.node_name, self.selector, self.port)

    def round(self) -> Round:
        peers = self.peers()
        if len(peers) > self.max_peers:  # a different sample each round: every peer gets measured over time
            peers = random.sample(peers, self.max_peers)
        result = measure(peers, self.rdma, self.samples, self.timeout)
        log.info("latency %s us over %s peers (%s)", result.latency_us, len(peers), result.method)
        if self.annotate and self.node_name and worth_publishing(result, self._last):
            self.publish(result)
        return result

    def publish(self, result: Round) -> None:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        annotations = dict(result.annotations(), **{keys.LATENCY_UPDATED: stamp})
        meta = {"name": self.node_name, "annotations": annotations}
        self.kube.patch({"apiVersion": "v1", "kind": "Node", "metadata": meta})
        self._last = result

    def run(self, interval: float) -> None:
        while not self._stop.is_set():
            try:
                self.round()
            except Exception as e:  # API server away, a peer list that failed: try again next round
                log.warning("latency round failed: %s", e)
            self._stop.wait(interval)

    def stop(self) -> None:
        self._stop.set()
