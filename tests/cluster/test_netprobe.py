"""`kubetune netprobe`: real TCP between network namespaces, the Node annotation through kmock's API server.

The fixture builds two network namespaces, each joined to this one by a veth pair with
addresses in 10.231.0.0/16 that exist only on those links; the peers' probers run there as
real `kubetune netprobe --serve-only` processes, and every probe crosses a veth. Nothing leaves
this machine. No RDMA device here: the ib_write_lat path is checked with a stand-in script
that prints perftest's report format (the parser is checked against real reports).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kubetune.cluster import nodefacts as keys
from kubetune.cluster.netprobe import (
    Peer,
    Prober,
    Round,
    measure,
    parse_peer,
    parse_perftest_latency,
    peers_from_pods,
    rdma_available,
    tcp_latency_us,
    worth_publishing,
)
from kubetune.errors import UserError
from kubetune.netutil import tcp_accepts, wait_ready

pytestmark = pytest.mark.process

KUBETUNE = [sys.executable, "-m", "kubetune"]
PORT = 7471


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and result.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


@pytest.fixture
def netns():
    """[(namespace, its address, a silent address on its link, its interface)] for two namespaces.

    Removed afterwards, also when the test fails."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = os.getpid() % 10000
    namespaces, links, sides = [], [], []
    try:
        for i, side in enumerate("ab"):
            ns, host_if, ns_if = f"kt-np-{tag}-{side}", f"ktnp{tag}{side}0", f"ktnp{tag}{side}1"
            _ip("netns", "del", ns, check=False)  # left over by a run that was killed: start clean
            added = _ip("netns", "add", ns, check=False)
            if added.returncode != 0:
                pytest.skip(f"`ip netns add` is not permitted here: {added.stderr.strip()}")
            namespaces.append(ns)
            _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            links.append(host_if)
            _ip("link", "set", ns_if, "netns", ns)
            subnet = f"10.231.{(tag % 120) * 2 + i}"
            _ip("addr", "add", f"{subnet}.1/29", "dev", host_if)
            _ip("link", "set", host_if, "up")
            for cmd in (["addr", "add", f"{subnet}.2/29", "dev", ns_if], ["link", "set", ns_if, "up"]):
                _ip("netns", "exec", ns, "ip", *cmd)
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
            sides.append((ns, f"{subnet}.2", f"{subnet}.3", ns_if))  # .3: on the link, but no one there
        yield sides
    finally:
        for link in links:
            _ip("link", "del", link, check=False)
        for ns in namespaces:
            _ip("netns", "del", ns, check=False)


@pytest.fixture
def peers(netns):
    """A `kubetune netprobe --serve-only` in each namespace, as a DaemonSet pod would run it."""
    procs = []
    try:
        for ns, address, _, _ in netns:
            cmd = ["ip", "netns", "exec", ns, *KUBETUNE, "netprobe", "--serve-only", "--listen", address]
            procs.append(
                subprocess.Popen([*cmd, "--port", str(PORT), "--log-level", "warning"], stderr=subprocess.PIPE)
            )
        for (_, address, _, _), proc in zip(netns, procs):
            accepts = functools.partial(tcp_accepts, address, PORT)
            wait_ready(accepts, 20, process=proc, interval=0.05, name=f"the prober on {address}:{PORT}")
        yield netns
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture
def api_server():
    pytest.importorskip("kmock")
    from tests.kit.kube import KmockServer

    server = KmockServer()
    server.client().create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "hls-0"}})
    yield server
    server.stop()


def _annotations(kube) -> dict:
    return kube.get("v1", "Node", "hls-0")["metadata"]["annotations"]


def test_prober_measures_across_namespaces_and_annotates_the_node(peers, api_server, tmp_path):
    (_, a, silent_a, _), (_, b, _, _) = peers
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(api_server.kubeconfig("netprobe"))
    flags = [
        "--peer",
        f"{a}:{PORT}",
        "--peer",
        f"{b}:{PORT}",
        "--peer",
        f"{b}:{PORT + 1}",
        "--peer",
        f"{silent_a}:{PORT}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"} | {"KUBECONFIG": str(kubeconfig)}
    result = subprocess.run(
        KUBETUNE + ["netprobe", "--once", "--node-name", "hls-0", "--timeout", "0.5", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout)
    latencies = measured["peers"]
    assert 0 < latencies[f"{a}:{PORT}"] < 50_000 and 0 < latencies[f"{b}:{PORT}"] < 50_000  # µs, one way
    assert latencies[f"{b}:{PORT + 1}"] is None  # refused: nothing listens there
    assert latencies[f"{silent_a}:{PORT}"] is None  # no host at that address: the connect timed out
    assert measured["method"] == "tcp"

    annotations = _annotations(api_server.client())
    assert annotations[keys.RDMA_LATENCY_US] == f"{measured['latency_us']:.2f}"
    assert annotations[keys.LATENCY_METHOD] == "tcp" and annotations[keys.LATENCY_PEERS] == "2/4"
    assert keys.LATENCY_UPDATED in annotations
    _the_extender_reads_it(api_server, measured["latency_us"])


def _the_extender_reads_it(api_server, latency_us: float) -> None:
    from kubetune.cluster.extender.facts import facts_of
    from kubetune.cluster.extender.protocol import Node

    raw = api_server.client().get("v1", "Node", "hls-0")
    facts = facts_of(Node.model_validate(raw), "habana.ai/gaudi", (keys.LEAF_LABEL,))
    assert facts.rdma_latency_us == pytest.approx(latency_us, abs=0.01)


def test_a_link_going_down_takes_the_latency_off_the_node(peers, api_server):
    (_, a, _, _), (_, b, _, _) = peers
    kube = api_server.client()
    prober = Prober("hls-0", [Peer("a", a, PORT), Peer("b", b, PORT)], None, {}, PORT, timeout=0.3, kube=kube)
    first = prober.round()
    assert first.latencies["a"] and first.latencies["b"]
    assert _annotations(kube)[keys.LATENCY_PEERS] == "2/2"

    for ns, _, _, link in peers:  # every peer's link down: no answer from anyone
        _ip("netns", "exec", ns, "ip", "link", "set", link, "down")
    second = prober.round()
    assert second.latencies == {"a": None, "b": None}
    annotations = _annotations(kube)
    assert keys.RDMA_LATENCY_US not in annotations  # no stale figure for the extender to score on
    assert annotations[keys.LATENCY_PEERS] == "0/2"


def test_peers_come_from_the_daemonsets_running_pods_through_the_api(api_server):
    kube = api_server.client()
    selector = {"app.kubernetes.io/name": "kubetune-netprobe"}

    def pod(name, node, ip, phase="Running", labels=selector):
        meta = {"name": name, "namespace": "kubetune-system", "labels": labels}
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"nodeName": node, "containers": []}}
        kube.create(dict(body, status={"phase": phase, "podIP": ip}))

    pod("p0", "hls-0", "10.0.0.10")  # this node's own prober
    pod("p1", "hls-1", "10.0.1.10")
    pod("p2", "hls-2", "10.0.2.10")
    pod("p3", "hls-3", None, phase="Pending")  # not up yet
    pod("other", "hls-4", "10.0.4.10", labels={"app.kubernetes.io/name": "something-else"})
    prober = Prober("hls-0", [], "kubetune-system", selector, PORT, kube=kube)
    assert prober.peers() == [Peer("hls-1", "10.0.1.10", PORT), Peer("hls-2", "10.0.2.10", PORT)]


def test_peers_from_pods_needs_running_pods_with_an_address_on_other_nodes():
    sel = {"app": "p"}
    pods = [
        {"metadata": {"labels": sel}, "spec": {"nodeName": "n1"}, "status": {"phase": "Running", "podIP": "10.1.0.1"}},
        {"metadata": {"labels": sel}, "spec": {"nodeName": "n0"}, "status": {"phase": "Running", "podIP": "10.0.0.1"}},
        {"metadata": {"labels": sel}, "spec": {"nodeName": "n2"}, "status": {"phase": "Running"}},
        {
            "metadata": {"labels": {"app": "q"}},
            "spec": {"nodeName": "n3"},
            "status": {"phase": "Running", "podIP": "x"},
        },
        {"metadata": {"labels": sel}, "spec": {"nodeName": "n4"}, "status": {"phase": "Failed", "podIP": "10.4.0.1"}},
    ]
    assert peers_from_pods(pods, "n0", sel, 9) == [Peer("n1", "10.1.0.1", 9)]


def test_tcp_latency_is_none_for_a_closed_port_on_loopback():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        assert tcp_latency_us("127.0.0.1", port, timeout=0.5) is None


# A real ib_write_lat client report (perftest 4.5), CPU-frequency warning included.
IB_WRITE_LAT = (Path(__file__).parent / "perftest_ib_write_lat.txt").read_text()


def test_perftest_report_gives_the_typical_latency():
    assert parse_perftest_latency(IB_WRITE_LAT) == 1.79
    assert parse_perftest_latency("Couldn't connect to 10.0.0.1:18515\nUnable to init the socket connection") is None


def test_rdma_is_used_when_perftest_and_a_device_are_there(tmp_path, monkeypatch):
    # Stand-in for perftest (this machine has no RDMA device): prints the real report for a peer.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "ib_write_lat"
    tool.write_text(f"#!/bin/sh\ncase \"$*\" in *10.9.9.9*) exit 1;; esac\ncat <<'EOF'\n{IB_WRITE_LAT}EOF\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    sysfs = tmp_path / "sys"
    assert not rdma_available(sysfs)  # perftest alone is not enough: no RDMA device
    (sysfs / "class/infiniband/mlx5_0").mkdir(parents=True)
    assert rdma_available(sysfs)
    assert measure([Peer("n1", "10.1.1.1", PORT)], rdma=True, samples=1, timeout=0.2) == Round("rdma", {"n1": 1.79})
    # a peer RDMA cannot reach is measured over TCP (here: refused, so None), and the round says tcp
    mixed = measure([Peer("n1", "10.1.1.1", PORT), Peer("n2", "10.9.9.9", 1)], rdma=True, samples=1, timeout=0.2)
    assert mixed.method == "tcp" and mixed.latencies["n1"] == 1.79


def test_only_a_change_worth_it_is_published():
    base = Round("tcp", {"a": 100.0, "b": 120.0})
    assert worth_publishing(base, None)
    assert not worth_publishing(Round("tcp", {"a": 104.0, "b": 125.0}), base)  # noise
    assert worth_publishing(Round("tcp", {"a": 150.0, "b": 160.0}), base)  # moved > 10%
    assert worth_publishing(Round("tcp", {"a": 100.0, "b": None}), base)  # a peer stopped answering
    assert worth_publishing(Round("rdma", {"a": 100.0, "b": 120.0}), base)


def test_bad_flags_are_one_line_each_naming_the_flag():
    for bad in ("node-3:", ":7471", "node-3:http", "node-3:70000"):
        with pytest.raises(UserError, match=f"--peer '{bad}': use HOST or HOST:PORT"):
            parse_peer(bad, PORT)
    assert parse_peer("fd00::7", PORT) == Peer("fd00::7", "fd00::7", PORT)  # a bare IPv6 address
    assert parse_peer("10.0.0.1", PORT) == Peer("10.0.0.1", "10.0.0.1", PORT)
    assert parse_peer("node-3:9000", PORT) == Peer("node-3:9000", "node-3", 9000)
    r = subprocess.run(KUBETUNE + ["netprobe", "--peer", "x:port"], capture_output=True, text=True, timeout=30)
    assert (
        r.returncode == 2
        and r.stderr.strip() == "kubetune: error: --peer 'x:port': use HOST or HOST:PORT, e.g. 10.0.3.7:7471"
    )
    r = subprocess.run(KUBETUNE + ["netprobe", "--peer", "10.0.0.1"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "kubetune: error: --annotate needs --node-name (or NODE_NAME from the downward API); or pass --no-annotate"
    ]


def test_rendered_prober_runs_where_the_plugin_runs_with_rbac_for_its_peers_and_node():
    from kubetune.cluster import manifests

    objects = manifests.render(manifests.ComponentSettings())
    ours = [o for o in objects if o["metadata"]["name"] == manifests.NETPROBE_NAME]
    assert [o["kind"] for o in ours] == [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "DaemonSet",
    ]
    ds = ours[-1]["spec"]["template"]["spec"]
    plugin = next(o for o in objects if o["kind"] == "DaemonSet" and o["metadata"]["name"] == manifests.PLUGIN_NAME)
    assert ds["affinity"] == plugin["spec"]["template"]["spec"]["affinity"]
    assert "hostNetwork" not in ds  # the pod network: what the training traffic crosses
    (container,) = ds["containers"]
    assert container["command"] + container["args"][:1] == ["kubetune", "pod", "netprobe"]
    assert {e["name"] for e in container["env"]} == {"NODE_NAME", "POD_NAMESPACE"}
    assert ours[1]["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    assert ours[3]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    assert not [o for o in manifests.render(manifests.ComponentSettings(netprobe=False)) if "netprobe" in str(o)]
