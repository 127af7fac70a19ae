"""The kubelet device plugin: serve v1beta1 on a unix socket, register, re-register on restart.

Pieces, in the order the data flows:

- `PluginState`: the cards, their health and a version number that goes up on every change;
  the health queue is drained into it by one thread, and ListAndWatch streams wait on it.
- `DevicePluginServicer`: translates between the protocol and the backend (`Discovery`) and
  the pure allocation policy; it decides nothing on its own.
- `DevicePlugin`: the lifecycle. Serve on `<plugin dir>/<socket>`, then Register on
  `kubelet.sock`; then watch the directory: a restarting kubelet deletes every socket in it
  and recreates `kubelet.sock`, which brings a re-serve and a re-registration.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from kubetune.cluster.deviceplugin import DEFAULT_PLUGIN_DIR, KUBELET_SOCKET
from kubetune.cluster.deviceplugin.allocation import preferred_allocation
from kubetune.cluster.deviceplugin.metrics import PluginMetrics
from kubetune.cluster.deviceplugin.proto import deviceplugin_pb2 as pb
from kubetune.cluster.deviceplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from kubetune.cluster.devices.discovery import HEALTHY, Card, Discovery
from kubetune.cluster.devices.health import HealthEvent, HealthMonitor

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"


def socket_name_for(resource: str) -> str:
    """`habana.ai/gaudi` -> `kubetune-habana.ai_gaudi.sock` (one socket per resource)."""
    return "kubetune-" + resource.replace("/", "_") + ".sock"


class PluginState:
    """Cards + health + a change counter. Thread-safe; ListAndWatch waits on `changed`."""

    def __init__(self, discovery: Discovery, health: dict[str, str]):
        self.resource = discovery.resource
        self.cards: dict[str, Card] = {c.id: c for c in discovery.devices()}
        self.health = {cid: health.get(cid, HEALTHY) for cid in self.cards}
        self.version = 0
        self.closed = False
        self.changed = threading.Condition()

    def apply(self, event: HealthEvent) -> bool:
        with self.changed:
            if event.device_id not in self.cards or self.health[event.device_id] == event.health:
                return False
            self.health[event.device_id] = event.health
            self.version += 1
            self.changed.notify_all()
            return True

    def replace_cards(self, cards: list[Card], health: dict[str, str]) -> bool:
        """A new set of cards (the driver came or went): True when it differs, and streams resend."""
        with self.changed:
            if {c.id for c in cards} == self.cards.keys():
                return False
            self.cards = {c.id: c for c in cards}
            self.health = {cid: health.get(cid, HEALTHY) for cid in self.cards}
            self.version += 1
            self.changed.notify_all()
            return True

    def snapshot(self) -> tuple[int, list[pb.Device]]:
        with self.changed:
            return self.version, [self._device(c) for c in self.cards.values()]

    def _device(self, card: Card) -> pb.Device:
        topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=card.numa_node)]) if card.numa_node is not None else None
        return pb.Device(ID=card.id, health=self.health[card.id], topology=topology)

    def wait_newer(self, version: int, timeout: float) -> bool:
        """Block until the state is newer than `version` (True) or timeout / close (False)."""
        with self.changed:
            self.changed.wait_for(lambda: self.version != version or self.closed, timeout=timeout)
            return self.version != version

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    """The v1beta1 DevicePlugin service: protocol in, backend + policy calls, protocol out."""

    def __init__(self, state: PluginState, discovery: Discovery, metrics: PluginMetrics, stopping: threading.Event):
        self.state = state
        self.discovery = discovery
        self.metrics = metrics
        self.stopping = stopping

    def GetDevicePluginOptions(self, request, context):
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(self, request, context):
        version, devices = self.state.snapshot()
        yield pb.ListAndWatchResponse(devices=devices)
        while context.is_active() and not self.stopping.is_set():
            if self.state.wait_newer(version, timeout=0.5):
                version, devices = self.state.snapshot()
                yield pb.ListAndWatchResponse(devices=devices)

    def GetPreferredAllocation(self, request, context):
        cards = self.state.cards
        responses = []
        for creq in request.container_requests:
            available = [cards[i] for i in creq.available_deviceIDs if i in cards]
            must = [cards[i] for i in creq.must_include_deviceIDs if i in cards]
            chosen = preferred_allocation(available, must, creq.allocation_size)
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=[c.id for c in chosen]))
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request, context):
        resource = self.state.resource
        responses = []
        for creq in request.container_requests:
            ids = list(creq.devices_ids)
            problem = self._refusal(ids)
            if problem:
                self.metrics.allocate_errors.labels(resource).inc()
                code, message = problem
                log.warning("Allocate refused: %s", message)
                context.abort(code, message)
            spec = self.discovery.allocate_spec([self.state.cards[i] for i in ids])
            responses.append(
                pb.ContainerAllocateResponse(
                    envs=spec.envs,
                    devices=[pb.DeviceSpec(container_path=p, host_path=p, permissions="rw") for p in spec.device_nodes],
                )
            )
            self.metrics.allocations.labels(resource).inc()
            self.metrics.allocated_devices.labels(resource).inc(len(ids))
        return pb.AllocateResponse(container_responses=responses)

    def _refusal(self, ids: list[str]) -> tuple[grpc.StatusCode, str] | None:
        resource = self.state.resource
        unknown = [i for i in ids if i not in self.state.cards]
        if unknown:
            return grpc.StatusCode.INVALID_ARGUMENT, f"{resource}: unknown device ids: {', '.join(unknown)}"
        with self.state.changed:
            unhealthy = [i for i in ids if self.state.health[i] != HEALTHY]
        if unhealthy:
            return grpc.StatusCode.FAILED_PRECONDITION, f"{resource}: unhealthy device ids: {', '.join(unhealthy)}"
        return None

    def PreStartContainer(self, request, context):
        return pb.PreStartContainerResponse()


def _stat_id(path: Path) -> tuple[int, int] | None:
    """Identity of a file: a recreated kubelet.sock has a new inode or ctime."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


class DevicePlugin:
    """Serve, register, keep health flowing, and come back after a kubelet restart."""

    def __init__(
        self,
        discovery: Discovery,
        plugin_dir: Path = DEFAULT_PLUGIN_DIR,
        socket_name: str | None = None,
        health_interval: float = 5.0,
        watch_interval: float = 1.0,
        metrics: PluginMetrics | None = None,
        on_change: Callable[[PluginState], None] | None = None,
    ):
        self.discovery = discovery
        self.resource = discovery.resource
        self.plugin_dir = Path(plugin_dir)
        self.socket_name = socket_name or socket_name_for(self.resource)
        self.watch_interval = watch_interval
        self.metrics = metrics or PluginMetrics()
        self.on_change = on_change
        self.events: queue.Queue[HealthEvent] = queue.Queue()
        baseline = discovery.probe()
        self.state = PluginState(discovery, baseline)
        self.metrics.set_health(self.resource, self.state.health)
        self.metrics.driver_present.labels(self.resource).set(1 if getattr(discovery, "present", True) else 0)
        self.monitor = HealthMonitor(discovery, self.events, health_interval)
        self.monitor.start(baseline)
        self._stop = threading.Event()
        self._server: grpc.Server | None = None
        self._serving_stop: threading.Event | None = None
        self._registered_kubelet: tuple[int, int] | None = None
        self._drainer = threading.Thread(target=self._drain_health, name="health-drain", daemon=True)
        self._drainer.start()

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / self.socket_name

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET

    # -- health --------------------------------------------------------------------------
    def _drain_health(self) -> None:
        while not self._stop.is_set():
            try:
                event = self.events.get(timeout=0.2)
            except queue.Empty:
                self._sync_cards()
                continue
            if self.state.apply(event):
                self.metrics.set_health(self.resource, self.state.health)
                self._notify()

    def _sync_cards(self) -> None:
        """Cards that appear once the driver does (WaitForDriver); a plain backend's list never changes."""
        cards = self.discovery.devices()
        if self.state.replace_cards(cards, self.discovery.probe() if cards else {}):
            log.info("%s: now %d cards", self.resource, len(cards))
            self.metrics.set_health(self.resource, self.state.health)
            self._notify()
        self.metrics.driver_present.labels(self.resource).set(1 if getattr(self.discovery, "present", True) else 0)

    def _notify(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self.state)
            except Exception:  # publishing facts is best effort; the plugin keeps serving
                log.exception("node facts hook failed")

    # -- serving and registration ---------------------------------------------------------
    def serve(self) -> None:
        """(Re)start the gRPC server on our socket; returns once the socket exists."""
        self._stop_server()
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists():
            self.socket_path.unlink()
        self._serving_stop = threading.Event()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="deviceplugin"))
        pb_grpc.add_DevicePluginServicer_to_server(
            DevicePluginServicer(self.state, self.discovery, self.metrics, self._serving_stop), server
        )
        if server.add_insecure_port(f"unix:{self.socket_path}") == 0:
            raise OSError(f"{self.resource}: cannot listen on {self.socket_path}")
        server.start()
        self._server = server
        log.info("%s: serving on %s", self.resource, self.socket_path)

    def _stop_server(self) -> None:
        if self._serving_stop is not None:
            self._serving_stop.set()
        if self._server is not None:
            self._server.stop(grace=0.5).wait()
            self._server = None

    def register(self, timeout: float = 5.0) -> None:
        """Call Register on kubelet.sock. Raises grpc.RpcError if the kubelet refuses or is absent."""
        kubelet_id = _stat_id(self.kubelet_socket)
        with grpc.insecure_channel(f"unix:{self.kubelet_socket}") as channel:
            pb_grpc.RegistrationStub(channel).Register(
                pb.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self.socket_name,
                    resource_name=self.resource,
                    options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
                ),
                timeout=timeout,
            )
        self._registered_kubelet = kubelet_id
        self.metrics.registrations.labels(self.resource).inc()
        log.info("%s: registered with the kubelet at %s", self.resource, self.kubelet_socket)

    def start(self) -> None:
        """Serve, then register once (a missing kubelet is retried by `watch_once`)."""
        self.serve()
        self._try_register()
        self._notify()

    def _try_register(self) -> bool:
        if _stat_id(self.kubelet_socket) is None:
            return False
        try:
            self.register()
            return True
        except grpc.RpcError as e:
            log.warning("%s: Register on %s failed (%s); will retry", self.resource, self.kubelet_socket, e.code())
            return False

    def watch_once(self) -> None:
        """One look at the directory: re-serve if our socket is gone, re-register if the kubelet is new."""
        self._ensure_serving()
        current = _stat_id(self.kubelet_socket)
        if current is not None and current != self._registered_kubelet:
            # The kubelet may have wiped the directory since the check above: never point it
            # at a socket that is not there.
            self._ensure_serving()
            self._try_register()

    def _ensure_serving(self) -> None:
        if not self.socket_path.exists():
            log.warning("%s: %s was removed (kubelet restart?); serving again", self.resource, self.socket_path)
            self.serve()
            self._registered_kubelet = None

    def run(self, stop: threading.Event | None = None) -> None:
        """Start, then watch the plugin directory until `stop` is set (or the plugin is stopped)."""
        stop = stop or threading.Event()
        self.start()
        while not stop.is_set() and not self._stop.is_set():
            stop.wait(self.watch_interval)
            if not stop.is_set():
                self.watch_once()

    def stop(self) -> None:
        self._stop.set()
        self.state.close()
        self.monitor.stop()
        self._stop_server()
        with contextlib.suppress(OSError):
            self.socket_path.unlink(missing_ok=True)
        self._drainer.join(timeout=2)
        self.discovery.close()


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Poll `predicate` until true or `timeout` seconds pass (tests and the CLI use it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
