"""Fakes for the cluster tests: a fake node (sysfs + /dev trees) and a fake kubelet.

Everything here is real where it can be: gRPC over unix sockets in tmp_path, files on disk.
"""

from __future__ import annotations

import queue
from concurrent import futures
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")

from kubetune.cluster.deviceplugin.proto import deviceplugin_pb2 as pb  # noqa: E402
from kubetune.cluster.deviceplugin.proto import deviceplugin_pb2_grpc as pb_grpc  # noqa: E402


def make_gaudi_tree(root: Path, cards: list[dict]) -> tuple[Path, Path]:
    """Write a fake node: `<root>/sys/bus/pci/drivers/habanalabs/<DBDF>/...` and `<root>/dev/accel/...`.

    Each card: {"pci": "0000:19:00.0", "device": "0x1020", "accel": 0, "module": 0, "numa": 0}.
    """
    sysfs, dev = root / "sys", root / "dev"
    driver = sysfs / "bus/pci/drivers/habanalabs"
    driver.mkdir(parents=True)
    for name in ("bind", "unbind", "new_id"):  # the driver dir has these files too
        (driver / name).write_text("")
    (dev / "accel").mkdir(parents=True)
    for c in cards:
        d = driver / c["pci"]
        (d / "accel" / f"accel{c['accel']}").mkdir(parents=True)
        (d / "device").write_text(c["device"] + "\n")
        (d / "module_id").write_text(f"{c['module']}\n")
        (d / "numa_node").write_text(f"{c['numa']}\n")
        (dev / "accel" / f"accel{c['accel']}").write_text("")
        (dev / "accel" / f"accel_controlD{c['accel']}").write_text("")
    return sysfs, dev


def hls_box(device: str = "0x1060", n: int = 8) -> list[dict]:
    """An 8-card box: cards 0-3 on NUMA 0, 4-7 on NUMA 1, module id = accel index."""
    return [
        {
            "pci": f"0000:{0x19 + 0x10 * i:02x}:00.0",
            "device": device,
            "accel": i,
            "module": i,
            "numa": 0 if i < n // 2 else 1,
        }
        for i in range(n)
    ]


class FakeKubelet(pb_grpc.RegistrationServicer):
    """The kubelet's Registration service on `<dir>/kubelet.sock`; records each RegisterRequest."""

    def __init__(self, plugin_dir: Path):
        self.plugin_dir = plugin_dir
        self.requests: queue.Queue[pb.RegisterRequest] = queue.Queue()
        self.server = None

    @property
    def socket(self) -> Path:
        return self.plugin_dir / "kubelet.sock"

    def Register(self, request, context):
        self.requests.put(request)
        return pb.Empty()

    def start(self) -> FakeKubelet:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_RegistrationServicer_to_server(self, self.server)
        assert self.server.add_insecure_port(f"unix:{self.socket}") != 0
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=0).wait()
            self.server = None

    def restart(self) -> None:
        """What a kubelet restart looks like from the directory: every socket gone, kubelet.sock new."""
        self.stop()
        for sock in self.plugin_dir.glob("*.sock"):
            sock.unlink()
        self.start()


class FakePodResources:
    """The kubelet's PodResources Lister on a unix socket; `pods` is what List answers."""

    def __init__(self, socket_path: Path):
        from kubetune.cluster.deviceplugin.proto import podresources_pb2_grpc as prgrpc

        self.socket = socket_path
        self.pods: list = []
        outer = self

        class Servicer(prgrpc.PodResourcesListerServicer):
            def List(self, request, context):
                from kubetune.cluster.deviceplugin.proto import podresources_pb2 as prpb

                return prpb.ListPodResourcesResponse(pod_resources=outer.pods)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        prgrpc.add_PodResourcesListerServicer_to_server(Servicer(), self.server)
        assert self.server.add_insecure_port(f"unix:{socket_path}") != 0
        self.server.start()

    def hold(self, pod: str, resource: str, device_ids: list[str]) -> None:
        from kubetune.cluster.deviceplugin.proto import podresources_pb2 as prpb

        self.pods.append(
            prpb.PodResources(
                name=pod,
                namespace="default",
                containers=[
                    prpb.ContainerResources(
                        name="main", devices=[prpb.ContainerDevices(resource_name=resource, device_ids=device_ids)]
                    )
                ],
            )
        )

    def stop(self) -> None:
        self.server.stop(grace=0).wait()
