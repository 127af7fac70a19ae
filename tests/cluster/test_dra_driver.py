"""The DRA driver as the DaemonSet runs it: a real `kubetune dra-driver` process, a test-side kubelet
(gRPC over the registration and DRA sockets), kmock as the API server (ResourceSlices, the claim)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kubetune.cluster.deviceplugin.server import wait_for
from kubetune.cluster.devices.discovery import HEALTHY
from kubetune.cluster.devices.inventory import InventoryDiscovery
from kubetune.cluster.dra.proto import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from kubetune.cluster.dra.proto import pluginregistration_pb2 as reg_pb
from kubetune.cluster.dra.proto import pluginregistration_pb2_grpc as reg_grpc
from kubetune.cluster.dra.slices import build_slices
from kubetune.contracts import dra
from tests.kit.kube import KmockServer

from .fakes import grpc
from .test_dra_prepare import cdi_validator

pytestmark = pytest.mark.process

KUBETUNE = [sys.executable, "-m", "kubetune"]
GAUDI = dra.VENDORS["gaudi"]
NODE = "node-a"


def _cards(unhealthy: int | None = None) -> list[dict]:
    return [
        {
            "id": f"0000:{0x19 + 0x10 * i:02x}:00.0",
            "model": "gaudi3",
            "index": i,
            "module_id": i,
            "numa_node": i // 2,
            "hbm_mib": 128 * 1024,
            "pcie_root": f"pci0000:{0x10 * (i // 2):02x}",
            "link_domain": "gaudi3-board",
            "health": "Unhealthy" if i == unhealthy else HEALTHY,
        }
        for i in range(4)
    ]


def _write_inventory(path: Path, unhealthy: int | None = None) -> None:
    tmp = path.with_suffix(".tmp")  # rename: the driver's probe never reads half a file
    tmp.write_text(yaml.safe_dump({"vendor": "habana", "cards": _cards(unhealthy)}))
    tmp.replace(path)


class Node:
    """The host directories, the inventory, kmock with the Node and one allocated claim, the driver process."""

    def __init__(self, root: Path):
        self.root = root
        self.registry, self.plugins, self.cdi = root / "reg", root / "plugins", root / "cdi"
        for d in (self.registry, self.plugins):
            d.mkdir()
        self.inventory = root / "cards.yaml"
        _write_inventory(self.inventory)
        self.kube = KmockServer(("resource.k8s.io/v1/resourceslices", "resource.k8s.io/v1/resourceclaims"))
        self.kubeconfig = root / "kubeconfig"
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "k", "cluster": {"server": self.kube.url}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "k", "context": {"cluster": "k", "user": "u"}}],
                    "current-context": "k",
                }
            )
        )
        self.api = self.kube.client()
        self.api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "uid": "node-uid-1"}})
        self.proc: subprocess.Popen | None = None

    def add_claim(self, name: str, uid: str, devices: list[str]) -> None:
        results = [{"request": "cards", "driver": GAUDI.driver, "pool": NODE, "device": d} for d in devices]
        claim = {
            "apiVersion": dra.RESOURCE_API_VERSION,
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "team", "uid": uid},
            "spec": {"devices": {"requests": [{"name": "cards", "exactly": {"deviceClassName": GAUDI.device_class}}]}},
            "status": {"allocation": {"devices": {"results": results}}},
        }
        self.api.create(claim)

    def delete_slices(self) -> None:
        """What a starting kubelet does to its node's slices."""
        for s in self.slices():
            self.api.delete(dra.RESOURCE_API_VERSION, "ResourceSlice", s["metadata"]["name"])

    def slices(self) -> list[dict]:
        return self.api.list(dra.RESOURCE_API_VERSION, "ResourceSlice")

    @property
    def reg_socket(self) -> Path:
        return self.registry / f"{GAUDI.driver}-reg.sock"

    def start(self) -> None:
        args = ["dra-driver", "--discovery", f"inventory:{self.inventory}", "--node-name", NODE]
        args += ["--registry-dir", str(self.registry), "--plugins-dir", str(self.plugins), "--cdi-dir", str(self.cdi)]
        args += ["--kubeconfig", str(self.kubeconfig), "--health-interval", "0.1", "--log-level", "warning"]
        self.proc = subprocess.Popen(KUBETUNE + args, stderr=subprocess.PIPE)
        assert wait_for(lambda: self.reg_socket.exists() or self.proc.poll() is not None, 30), "no registration socket"
        assert self.proc.poll() is None, self.proc.stderr.read().decode()

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.kube.stop()


def _register(node: Node) -> reg_pb.PluginInfo:
    """What the kubelet's plugin watcher does: GetInfo, then NotifyRegistrationStatus."""
    with grpc.insecure_channel(f"unix:{node.reg_socket}") as channel:
        stub = reg_grpc.RegistrationStub(channel)
        info = stub.GetInfo(reg_pb.InfoRequest(), timeout=10)
        stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=10)
    return info


def _claims(pb, *claims: tuple[str, str]):
    return [pb.Claim(namespace="team", name=name, uid=uid) for name, uid in claims]


def _prepare(endpoint: str, pb=dra_v1_pb2, pb_grpc=dra_v1_pb2_grpc, *claims):
    with grpc.insecure_channel(f"unix:{endpoint}") as channel:
        request = pb.NodePrepareResourcesRequest(claims=_claims(pb, *claims))
        return pb_grpc.DRAPluginStub(channel).NodePrepareResources(request, timeout=10)


def _unprepare(endpoint: str, *claims):
    pb = dra_v1_pb2
    with grpc.insecure_channel(f"unix:{endpoint}") as channel:
        request = pb.NodeUnprepareResourcesRequest(claims=_claims(pb, *claims))
        return dra_v1_pb2_grpc.DRAPluginStub(channel).NodeUnprepareResources(request, timeout=10)


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.close()


def test_dra_driver_registers_prepares_survives_a_restart_and_unprepares(node):
    node.add_claim("train-0", "11111111-aaaa", ["gaudi-1", "gaudi-2"])
    node.start()
    info = _register(node)
    assert (info.type, info.name) == ("DRAPlugin", GAUDI.driver)
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    endpoint = info.endpoint
    assert endpoint == str(node.plugins / GAUDI.driver / "dra.sock") and Path(endpoint).exists()

    answer = _prepare(endpoint, dra_v1_pb2, dra_v1_pb2_grpc, ("train-0", "11111111-aaaa"), ("gone", "2222"))
    assert "not found" in answer.claims["2222"].error  # one claim's error, not a failed call
    prepared = answer.claims["11111111-aaaa"]
    assert prepared.error == ""
    kind = GAUDI.cdi_kind
    assert [(d.device_name, d.pool_name, list(d.request_names), list(d.cdi_device_ids)) for d in prepared.devices] == [
        ("gaudi-1", NODE, ["cards"], [f"{kind}=11111111-aaaa-gaudi-1"]),
        ("gaudi-2", NODE, ["cards"], [f"{kind}=11111111-aaaa-gaudi-2"]),
    ]
    (spec_file,) = node.cdi.iterdir()
    assert spec_file.name == "kubetune.io-gaudi_11111111-aaaa.json"
    spec = json.loads(spec_file.read_text())
    cdi_validator().validate(spec)
    assert spec["kind"] == kind
    assert "HABANA_VISIBLE_DEVICES=1,2" in spec["containerEdits"]["env"]
    nodes = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]}
    assert nodes == {
        "11111111-aaaa-gaudi-1": ["/dev/accel/accel1", "/dev/accel/accel_controlD1"],
        "11111111-aaaa-gaudi-2": ["/dev/accel/accel2", "/dev/accel/accel_controlD2"],
    }
    # the kubelet may repeat itself, on either API version: the same answer, still one file
    again = _prepare(endpoint, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc, ("train-0", "11111111-aaaa"))
    v1beta1_ids = [list(d.cdi_device_ids) for d in again.claims["11111111-aaaa"].devices]
    assert v1beta1_ids == [list(d.cdi_device_ids) for d in prepared.devices]
    assert len(list(node.cdi.iterdir())) == 1

    node.reg_socket.unlink()  # deregistered: the driver serves the socket again for the plugin watcher
    assert wait_for(node.reg_socket.exists, 20)
    assert _register(node).endpoint == endpoint

    assert node.stop() == 0
    assert not node.reg_socket.exists() and not Path(endpoint).exists()  # its own sockets, removed on exit
    node.start()  # a new process: only the checkpoint knows the claim now
    _register(node)
    assert _unprepare(endpoint, ("train-0", "11111111-aaaa")).claims["11111111-aaaa"].error == ""
    assert list(node.cdi.iterdir()) == []
    checkpoint = json.loads((node.plugins / GAUDI.driver / "checkpoint.json").read_text())
    assert checkpoint["claims"] == {}
    assert _unprepare(endpoint, ("train-0", "11111111-aaaa")).claims["11111111-aaaa"].error == ""  # idempotent
    assert node.stop() == 0
    left = sorted(str(p.relative_to(node.root)) for p in node.root.rglob("*") if p.is_file() or p.is_socket())
    assert left == ["cards.yaml", "kubeconfig", f"plugins/{GAUDI.driver}/checkpoint.json"]


def test_dra_driver_publishes_the_inventory_and_republishes_on_health_changes(node):
    node.start()
    assert wait_for(lambda: len(node.slices()) == 1, 20)
    (published,) = node.slices()
    cards = InventoryDiscovery(node.inventory).devices()
    expected = build_slices(NODE, GAUDI, cards, {c.id: HEALTHY for c in cards}, 0, "node-uid-1")[0]
    assert published["spec"]["devices"] == expected["spec"]["devices"]
    by_name = {d["name"]: d["attributes"] for d in published["spec"]["devices"]}
    assert {n: (a[dra.ATTR_UUID]["string"], a[dra.ATTR_PCIE_ROOT]["string"]) for n, a in by_name.items()} == {
        f"gaudi-{c['index']}": (c["id"], c["pcie_root"]) for c in _cards()
    }  # the inventory's own facts, not only build_slices' reading of them
    assert published["metadata"]["ownerReferences"] == expected["metadata"]["ownerReferences"]
    first = published["spec"]["pool"]["generation"]

    _write_inventory(node.inventory, unhealthy=3)
    health = lambda: node.slices()[0]["spec"]["devices"][3]["attributes"][dra.ATTR_HEALTHY]  # noqa: E731
    assert wait_for(lambda: health() == {"bool": False}, 20)
    assert node.slices()[0]["spec"]["pool"]["generation"] > first
    _write_inventory(node.inventory)
    assert wait_for(lambda: health() == {"bool": True}, 20)

    # a kubelet restart: it deletes the node's slices, then registers the driver again
    generation = node.slices()[0]["spec"]["pool"]["generation"]
    node.delete_slices()
    _register(node)
    assert wait_for(lambda: len(node.slices()) == 1, 20), "the slices did not come back"
    assert node.slices()[0]["spec"]["pool"]["generation"] > generation
    assert node.stop() == 0


def test_dra_driver_bad_flags_exit_2_with_one_line(tmp_path):
    r = subprocess.run(
        KUBETUNE + ["dra-driver", "--node-name", "n", "--registry-dir", str(tmp_path / "no"), "--plugins-dir", "."],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"kubetune: error: --registry-dir {tmp_path / 'no'}: not a directory; "
        "mount the kubelet's directory at the same path"
    )


def test_dra_driver_modules_do_not_import_torch():
    code = (
        "import sys, kubetune.cluster.dra.server, kubetune.cluster.dra.publish, kubetune.cluster.manifests; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('kubetune.training')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
