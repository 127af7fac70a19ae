"""The DRA driver's node side: the kubelet's gRPC services on unix sockets, slices kept current.

- `DraServicer`: DRAPlugin (v1, and v1beta1 through the same code: the two protos differ only
  by v1's `share_id`) translating NodePrepare/NodeUnprepareResources to `Preparer` calls;
- `RegistrationServicer`: the kubelet's plugin watcher finds `<registry>/<driver>-reg.sock`,
  calls GetInfo (type DRAPlugin, our driver name, the DRA socket, the versions newest first)
  and reports with NotifyRegistrationStatus;
- `DraDriver`: the lifecycle. The DRA service first (`<plugins>/<driver>/dra.sock`), then the
  registration socket, as the Go helper orders them; the slices published and republished
  when the health probe (devices/health.py's loop) reports a change; both sockets
  removed on exit, the checkpoint kept (claims stay prepared across a restart).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from types import ModuleType

import grpc

from kubetune.cluster.devices.discovery import HEALTHY, Discovery
from kubetune.cluster.devices.health import HealthEvent, HealthMonitor
from kubetune.cluster.dra import DEFAULT_CDI_DIR, DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR, cdi
from kubetune.cluster.dra.prepare import ClaimError, ClaimRef, Preparer
from kubetune.cluster.dra.proto import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from kubetune.cluster.dra.proto import pluginregistration_pb2 as reg_pb
from kubetune.cluster.dra.proto import pluginregistration_pb2_grpc as reg_grpc
from kubetune.cluster.dra.publish import SlicePublisher
from kubetune.contracts import dra

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"  # pluginregistration/v1 constants.go
SUPPORTED_VERSIONS = ["v1.DRAPlugin", "v1beta1.DRAPlugin"]  # the kubelet takes the first it knows


def registration_socket(registry_dir: Path, vendor: dra.DraVendor) -> Path:
    return Path(registry_dir) / f"{vendor.driver}-reg.sock"


def plugin_data_dir(plugins_dir: Path, vendor: dra.DraVendor) -> Path:
    return Path(plugins_dir) / vendor.driver


class DraServicer:
    """NodePrepareResources / NodeUnprepareResources for one proto version (`pb`)."""

    def __init__(self, preparer: Preparer, pb: ModuleType):
        self.preparer = preparer
        self.pb = pb

    def NodePrepareResources(self, request, context):
        pb = self.pb
        answers = {}
        for claim in request.claims:
            try:
                devices = self.preparer.prepare(ClaimRef(claim.namespace, claim.name, claim.uid))
            except (ClaimError, OSError) as e:  # OSError: the CDI dir or the checkpoint cannot be written
                log.warning("prepare %s/%s: %s", claim.namespace, claim.name, e)
                answers[claim.uid] = pb.NodePrepareResourceResponse(error=str(e))
                continue
            answers[claim.uid] = pb.NodePrepareResourceResponse(
                devices=[
                    pb.Device(
                        request_names=d.request_names,
                        pool_name=d.pool_name,
                        device_name=d.device_name,
                        cdi_device_ids=d.cdi_device_ids,
                    )
                    for d in devices
                ]
            )
        return pb.NodePrepareResourcesResponse(claims=answers)

    def NodeUnprepareResources(self, request, context):
        pb = self.pb
        answers = {}
        for claim in request.claims:
            try:
                self.preparer.unprepare(claim.uid)
                answers[claim.uid] = pb.NodeUnprepareResourceResponse()
            except OSError as e:  # the CDI dir or the checkpoint cannot be written: the kubelet retries
                answers[claim.uid] = pb.NodeUnprepareResourceResponse(error=f"unprepare {claim.uid}: {e}")
        return pb.NodeUnprepareResourcesResponse(claims=answers)


class V1Servicer(DraServicer, dra_v1_pb2_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer):
        super().__init__(preparer, dra_v1_pb2)


class V1beta1Servicer(DraServicer, dra_v1beta1_pb2_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer):
        super().__init__(preparer, dra_v1beta1_pb2)


class RegistrationServicer(reg_grpc.RegistrationServicer):
    def __init__(self, vendor: dra.DraVendor, endpoint: Path, on_registered: Callable[[], None]):
        self.vendor = vendor
        self.endpoint = endpoint
        self.on_registered = on_registered  # a (re)starting kubelet has just deleted this node's slices
        self.registered = threading.Event()

    def GetInfo(self, request, context):
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.vendor.driver,
            endpoint=str(self.endpoint),
            supported_versions=SUPPORTED_VERSIONS,
        )

    def NotifyRegistrationStatus(self, request, context):
        if request.plugin_registered:
            log.info("%s: registered with the kubelet", self.vendor.driver)
            self.registered.set()
            self.on_registered()
        else:
            log.error("%s: the kubelet refused the registration: %s", self.vendor.driver, request.error)
            self.registered.clear()
        return reg_pb.RegistrationStatusResponse()


def _serve(socket: Path, add: list, name: str) -> grpc.Server:
    socket.unlink(missing_ok=True)  # a socket left by a killed run of ours
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=name))
    for add_to_server in add:
        add_to_server(server)
    if server.add_insecure_port(f"unix:{socket}") == 0:
        raise OSError(f"cannot listen on {socket}")
    server.start()
    return server


class DraDriver:
    """Serve, register, publish; republish on health changes; clean up our sockets on stop."""

    def __init__(
        self,
        vendor: dra.DraVendor,
        node_name: str,
        discovery: Discovery,
        publisher: SlicePublisher | None,
        read_claim: Callable[[str, str], dict | None],
        registry_dir: Path = DEFAULT_REGISTRY_DIR,
        plugins_dir: Path = DEFAULT_PLUGINS_DIR,
        cdi_dir: Path = DEFAULT_CDI_DIR,
        health_interval: float = 5.0,
        resync_interval: float = 60.0,
    ):
        self.vendor = vendor
        self.node_name = node_name
        self.discovery = discovery
        self.publisher = publisher
        self.data_dir = plugin_data_dir(plugins_dir, vendor)
        self.dra_socket = self.data_dir / "dra.sock"
        self.reg_socket = registration_socket(registry_dir, vendor)
        self.cdi_dir = Path(cdi_dir)
        self.health_interval = health_interval
        self.resync_interval = resync_interval
        self.health = {c.id: HEALTHY for c in discovery.devices()}
        self.health.update(discovery.probe())
        self._health_lock = threading.Lock()
        self.events: queue.Queue[HealthEvent] = queue.Queue()
        self.monitor = HealthMonitor(discovery, self.events, health_interval)
        self.checkpoint = cdi.Checkpoint(self.data_dir / "checkpoint.json")
        self.preparer = Preparer(
            vendor, node_name, discovery, self.health_now, read_claim, self.cdi_dir, self.checkpoint
        )
        self.registration = RegistrationServicer(vendor, self.dra_socket, self._resync_soon)
        self._servers: dict[Path, grpc.Server] = {}
        self._stop = threading.Event()
        self._dirty = True  # slices not yet written (or the last write failed)
        self._next_resync = time.monotonic() + resync_interval
        self._drainer = threading.Thread(target=self._drain, name="dra-health", daemon=True)

    def health_now(self) -> dict[str, str]:
        with self._health_lock:
            return dict(self.health)

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        self._serve_dra()
        self._serve_registration()
        log.info("%s: DRA service on %s, registration on %s", self.vendor.driver, self.dra_socket, self.reg_socket)
        self._publish()
        self.monitor.start(self.health_now())
        self._drainer.start()

    def _serve_dra(self) -> None:
        self._servers[self.dra_socket] = _serve(
            self.dra_socket,
            [
                lambda s: dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(V1Servicer(self.preparer), s),
                lambda s: dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(V1beta1Servicer(self.preparer), s),
            ],
            "dra",
        )

    def _serve_registration(self) -> None:
        self._servers[self.reg_socket] = _serve(
            self.reg_socket,
            [lambda s: reg_grpc.add_RegistrationServicer_to_server(self.registration, s)],
            "dra-registration",
        )

    def _ensure_serving(self) -> None:
        """A socket someone removed is served again (the DRA one first, as at start): deleting the
        registration socket deregisters the plugin, and a plugin the kubelet cannot reach is lost."""
        for sock, serve in ((self.dra_socket, self._serve_dra), (self.reg_socket, self._serve_registration)):
            if not sock.exists():
                log.warning("%s: %s was removed; serving it again", self.vendor.driver, sock)
                old = self._servers.pop(sock, None)
                if old is not None:
                    old.stop(grace=0)
                serve()

    def _publish(self) -> None:
        if self.publisher is None:
            self._dirty = False
            return
        try:
            self.publisher.publish(self.discovery.devices(), self.health_now())
            self._dirty = False
        except Exception as e:  # API server away: keep serving the kubelet, write again on the next tick
            log.warning("%s: publishing ResourceSlices failed (%s); retrying", self.vendor.driver, e)
            self._dirty = True

    def _resync_soon(self) -> None:
        self._next_resync = 0.0

    def _resync(self) -> None:
        self._next_resync = time.monotonic() + self.resync_interval
        if self.publisher is None:
            return
        try:
            self.publisher.resync(self.discovery.devices(), self.health_now())
        except Exception as e:  # as _publish: the next interval tries again
            log.warning("%s: checking the ResourceSlices failed (%s)", self.vendor.driver, e)

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                event = self.events.get(timeout=min(self.health_interval, self.resync_interval))
            except queue.Empty:
                self._sync_cards()
                if self._dirty:
                    self._publish()
                elif time.monotonic() >= self._next_resync:
                    self._resync()
                continue
            with self._health_lock:
                changed = self.health.get(event.device_id) != event.health
                self.health[event.device_id] = event.health
            if changed:
                self._publish()

    def _sync_cards(self) -> None:
        """Cards that appear once the driver does (WaitForDriver): new ids start as probed."""
        cards = self.discovery.devices()
        with self._health_lock:
            if {c.id for c in cards} == self.health.keys():
                return
            probed = self.discovery.probe() if cards else {}
            self.health = {c.id: probed.get(c.id, HEALTHY) for c in cards}
        self._dirty = True

    def wait(self, stop: threading.Event, watch_interval: float = 1.0) -> None:
        """Until `stop`: look at the sockets every `watch_interval` seconds."""
        while not stop.wait(watch_interval) and not self._stop.is_set():
            self._ensure_serving()

    def stop(self) -> None:
        self._stop.set()
        self.monitor.stop()
        for server in self._servers.values():
            server.stop(grace=0.5).wait()
        self._servers.clear()
        for sock in (self.reg_socket, self.dra_socket):
            with contextlib.suppress(OSError):
                sock.unlink(missing_ok=True)
        if self._drainer.is_alive():
            self._drainer.join(timeout=2)
        self.discovery.close()
