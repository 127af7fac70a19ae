"""The device plugin against a fake kubelet, over real gRPC on unix sockets in tmp_path."""

from __future__ import annotations

import queue
import threading

import grpc
import pytest

from kubetune.cluster.deviceplugin.proto import deviceplugin_pb2 as pb
from kubetune.cluster.deviceplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from kubetune.cluster.deviceplugin.server import DevicePlugin, wait_for
from kubetune.cluster.devices.gaudi import SysfsGaudiDiscovery

from .fakes import hls_box, make_gaudi_tree

RESOURCE = "habana.ai/gaudi"


@pytest.fixture
def node(tmp_path):
    return make_gaudi_tree(tmp_path / "node", hls_box("0x1060", 8))


@pytest.fixture
def plugin(node, plugin_dir, kubelet):
    sysfs, dev = node
    p = DevicePlugin(SysfsGaudiDiscovery(RESOURCE, sysfs, dev), plugin_dir, health_interval=0.05, watch_interval=0.05)
    stop = threading.Event()
    runner = threading.Thread(target=p.run, args=(stop,), daemon=True)
    runner.start()
    yield p
    stop.set()
    runner.join(timeout=5)
    p.stop()


@pytest.fixture
def stub(plugin):
    assert wait_for(plugin.socket_path.exists, 5)
    with grpc.insecure_channel(f"unix:{plugin.socket_path}") as channel:
        # the socket file exists from bind(), a moment before the server listens on it
        grpc.channel_ready_future(channel).result(timeout=5)
        yield pb_grpc.DevicePluginStub(channel)


def test_register_request_names_resource_socket_and_options(plugin, kubelet):
    req = kubelet.requests.get(timeout=5)
    assert req.version == "v1beta1"
    assert req.resource_name == RESOURCE
    assert req.endpoint == plugin.socket_name and "/" not in req.endpoint
    assert (kubelet.plugin_dir / req.endpoint).exists()  # served before registering
    assert req.options.get_preferred_allocation_available and not req.options.pre_start_required


def test_options_advertise_preferred_allocation(stub):
    opts = stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
    assert opts.get_preferred_allocation_available is True and opts.pre_start_required is False


def _next(stream_queue: queue.Queue, timeout=5.0) -> pb.ListAndWatchResponse:
    item = stream_queue.get(timeout=timeout)
    if isinstance(item, Exception):
        raise item
    return item


def test_list_and_watch_sends_full_list_then_resends_on_health_flip(stub, node):
    _sysfs, dev = node
    stream = stub.ListAndWatch(pb.Empty())
    got: queue.Queue = queue.Queue()

    def pump():
        try:
            for msg in stream:
                got.put(msg)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                got.put(e)

    threading.Thread(target=pump, daemon=True).start()
    try:
        first = _next(got)
        assert len(first.devices) == 8
        assert {d.health for d in first.devices} == {"Healthy"}
        numa = {d.ID: [n.ID for n in d.topology.nodes] for d in first.devices}
        assert sorted(numa.values()) == [[0]] * 4 + [[1]] * 4

        (dev / "accel" / "accel3").unlink()  # card 3 loses its device node
        second = _next(got)
        assert len(second.devices) == 8  # a full replacement, not a delta
        sick = [d.ID for d in second.devices if d.health == "Unhealthy"]
        assert sick == ["0000:49:00.0"]

        (dev / "accel" / "accel3").write_text("")  # and comes back
        third = _next(got)
        assert {d.health for d in third.devices} == {"Healthy"}
    finally:
        stream.cancel()


def test_allocate_gives_device_nodes_and_env(stub, plugin):
    ids = sorted(plugin.state.cards)
    resp = stub.Allocate(
        pb.AllocateRequest(
            container_requests=[
                pb.ContainerAllocateRequest(devices_ids=[ids[5], ids[4]]),
                pb.ContainerAllocateRequest(devices_ids=ids),
            ]
        ),
        timeout=5,
    )
    assert len(resp.container_responses) == 2
    two, whole = resp.container_responses
    assert dict(two.envs) == {
        "HABANA_VISIBLE_DEVICES": "4,5",
        "HL_VISIBLE_DEVICES": "4,5",
        "HABANA_VISIBLE_MODULES": "4,5",
    }
    assert [(d.container_path, d.host_path, d.permissions) for d in two.devices] == [
        ("/dev/accel/accel4", "/dev/accel/accel4", "rw"),
        ("/dev/accel/accel_controlD4", "/dev/accel/accel_controlD4", "rw"),
        ("/dev/accel/accel5", "/dev/accel/accel5", "rw"),
        ("/dev/accel/accel_controlD5", "/dev/accel/accel_controlD5", "rw"),
    ]
    assert "HABANA_VISIBLE_MODULES" not in whole.envs and len(whole.devices) == 16
    value = plugin.metrics.registry.get_sample_value(
        "kubetune_deviceplugin_allocated_devices_total", {"resource": RESOURCE}
    )
    assert value == 10


def test_allocate_refuses_unknown_and_unhealthy_ids_by_name(stub, plugin, node):
    with pytest.raises(grpc.RpcError) as e:
        stub.Allocate(
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=["0000:19:00.0", "bogus-7"])]
            ),
            timeout=5,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bogus-7" in e.value.details() and RESOURCE in e.value.details()

    _sysfs, dev = node
    (dev / "accel" / "accel_controlD0").unlink()
    assert wait_for(lambda: plugin.state.health["0000:19:00.0"] == "Unhealthy", 5)
    with pytest.raises(grpc.RpcError) as e:
        stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["0000:19:00.0"])]),
            timeout=5,
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "unhealthy device ids: 0000:19:00.0" in e.value.details()


def test_preferred_allocation_keeps_must_include_then_numa_then_adjacent_modules(stub, plugin):
    by_index = {c.index: c.id for c in plugin.state.cards.values()}
    everything = list(by_index.values())

    def ask(available, must, size):
        resp = stub.GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=[by_index[i] for i in available],
                        must_include_deviceIDs=[by_index[i] for i in must],
                        allocation_size=size,
                    )
                ]
            ),
            timeout=5,
        )
        (only,) = resp.container_responses
        inverse = {v: k for k, v in by_index.items()}
        return sorted(inverse[i] for i in only.deviceIDs)

    assert len(everything) == 8
    assert ask(range(8), [6], 3) == [4, 5, 6]  # must_include's NUMA node (4-7), adjacent modules
    assert ask([0, 2, 3, 6], [], 2) == [2, 3]  # adjacent modules within NUMA 0 beat 0+2
    assert ask([0, 2, 3, 4, 5], [], 2) == [4, 5]  # then best fit: NUMA 1 is used up, NUMA 0 kept
    assert ask([0, 3, 4, 5, 6, 7], [0], 2) == [0, 3]  # stay on NUMA 0 even if not adjacent
    assert ask([1, 4, 5, 6, 7], [], 4) == [4, 5, 6, 7]  # one NUMA node holds all four
    assert ask([1, 2, 4], [1], 8) == [1, 2, 4]  # not enough: all that is available


def test_kubelet_restart_brings_second_registration(plugin, kubelet):
    def registrations() -> float:
        return plugin.metrics.registry.get_sample_value(
            "kubetune_deviceplugin_registrations_total", {"resource": RESOURCE}
        )

    first = kubelet.requests.get(timeout=5)
    # The fake kubelet queues the request before it answers: restarting before the answer has
    # reached the plugin would fail that first Register (not counted), which is not the case here.
    assert wait_for(lambda: registrations() == 1, 5)
    kubelet.restart()  # deletes every socket, recreates kubelet.sock
    second = kubelet.requests.get(timeout=5)
    assert second.endpoint == first.endpoint and second.resource_name == RESOURCE
    assert wait_for(plugin.socket_path.exists, 5)  # served again
    with grpc.insecure_channel(f"unix:{plugin.socket_path}") as channel:
        opts = pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty(), timeout=5, wait_for_ready=True)
    assert opts.get_preferred_allocation_available
    # counted once Register has returned; a restart seen mid-look may bring one more, never fewer
    assert wait_for(lambda: registrations() >= 2, 5)


def test_plugin_started_before_kubelet_registers_when_it_appears(node, plugin_dir):
    from .fakes import FakeKubelet

    sysfs, dev = node
    p = DevicePlugin(SysfsGaudiDiscovery(RESOURCE, sysfs, dev), plugin_dir, health_interval=0.05, watch_interval=0.05)
    stop = threading.Event()
    runner = threading.Thread(target=p.run, args=(stop,), daemon=True)
    runner.start()
    k = FakeKubelet(plugin_dir)
    try:
        assert wait_for(p.socket_path.exists, 5)
        k.start()
        assert k.requests.get(timeout=5).resource_name == RESOURCE
    finally:
        k.stop()
        stop.set()
        runner.join(timeout=5)
        p.stop()


def _pump(stub) -> tuple[queue.Queue, object]:
    stream = stub.ListAndWatch(pb.Empty())
    got: queue.Queue = queue.Queue()

    def pump():
        try:
            for msg in stream:
                got.put(msg)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                got.put(e)

    threading.Thread(target=pump, daemon=True).start()
    return got, stream


def test_node_without_the_driver_serves_zero_cards_then_the_cards_once_the_driver_loads(
    tmp_path, plugin_dir, kubelet, caplog
):
    # the DaemonSet's pod on a node whose habanalabs driver is not loaded (yet): no exit, no crash loop
    from kubetune.cluster.devices.factory import make_discovery

    node = tmp_path / "node"
    node.mkdir()
    backend = make_discovery("sysfs", RESOURCE, node / "sys", node / "dev", wait_for_driver=0.05)
    p = DevicePlugin(backend, plugin_dir, health_interval=0.05, watch_interval=0.05)
    stop = threading.Event()
    runner = threading.Thread(target=p.run, args=(stop,), daemon=True)
    runner.start()
    try:
        assert kubelet.requests.get(timeout=5).resource_name == RESOURCE  # registered with nothing to offer
        assert "no cards to advertise" in caplog.text and "habanalabs" in caplog.text

        def metric(name, **labels):
            return p.metrics.registry.get_sample_value(name, {"resource": RESOURCE, **labels})

        assert metric("kubetune_deviceplugin_driver_present") == 0
        assert metric("kubetune_deviceplugin_devices", health="Healthy") == 0
        with grpc.insecure_channel(f"unix:{p.socket_path}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            got, stream = _pump(stub)
            try:
                assert len(_next(got).devices) == 0
                with pytest.raises(grpc.RpcError) as e:
                    stub.Allocate(
                        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["x"])]),
                        timeout=5,
                    )
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

                # the driver loads: the whole tree appears at once (a rename), as a finished probe would
                staging = tmp_path / "staging"
                make_gaudi_tree(staging, hls_box("0x1060", 8))
                (staging / "dev").rename(node / "dev")
                (staging / "sys").rename(node / "sys")
                loaded = _next(got)
                assert len(loaded.devices) == 8 and {d.health for d in loaded.devices} == {"Healthy"}
            finally:
                stream.cancel()
        assert wait_for(lambda: metric("kubetune_deviceplugin_driver_present") == 1, 5)
        assert metric("kubetune_deviceplugin_devices", health="Healthy") == 8
        assert "driver found, 8 cards" in caplog.text
    finally:
        stop.set()
        runner.join(timeout=5)
        p.stop()
