"""Commands of the cluster components: `device-plugin`, `dra-driver`, `scheduler-extender`, `netprobe`,
`k8s render-components`.

`register(app, k8s_app)` is called by kubetune.cli. Commands parse, check their flags, then
hand over to one function; grpc, fastapi and kubernetes are imported inside them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import typer

from kubetune.cluster import nodefacts as keys
from kubetune.cluster.manifests import ComponentSettings
from kubetune.cluster.settings import DevicePluginSettings, DraDriverSettings, ExtenderSettings, NetprobeSettings
from kubetune.errors import UserError
from kubetune.flags import settings_from, with_options

log = logging.getLogger("kubetune.cluster")


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


@with_options(DevicePluginSettings, "s", build=True)
def device_plugin(s: DevicePluginSettings):
    """Advertise whole accelerator cards to the kubelet (device plugin API v1beta1)."""
    _logging(s.log_level)
    problems = _device_plugin_problems(s)
    if problems:
        raise UserError(*problems)

    from kubetune.cluster.deviceplugin.server import DevicePlugin
    from kubetune.cluster.devices.factory import make_discovery

    # A node without the driver (or without cards) keeps the pod running with 0 cards advertised,
    # as the vendor plugins do; only a broken image or bad flags end the process.
    backend = make_discovery(s.discovery, s.resource, s.sysfs_root, s.dev_root, wait_for_driver=s.health_interval)
    publisher = _node_publisher(s, backend) if s.publish_node_facts else None
    plugin = DevicePlugin(
        backend,
        s.plugin_dir,
        health_interval=s.health_interval,
        watch_interval=s.watch_interval,
        on_change=publisher.hook if publisher else None,
    )
    if s.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(s.metrics_port, registry=plugin.metrics.registry)
    if publisher:
        threading.Thread(target=publisher.run, args=(plugin.state,), name="node-facts", daemon=True).start()
    log.info("%s: %d cards via %s", s.resource, len(backend.devices()), s.discovery)
    stop = _stop_on_signals()
    try:
        plugin.run(stop)
    finally:
        if publisher:
            publisher.stop()
        plugin.stop()


def _device_plugin_problems(s: DevicePluginSettings) -> list[str]:
    problems = []
    if s.health_interval <= 0 or s.watch_interval <= 0 or s.publish_interval <= 0:
        problems.append("--health-interval, --watch-interval and --publish-interval must be > 0 seconds")
    if "/" not in s.resource:
        problems.append(
            f"--resource {s.resource!r}: an extended resource looks like vendor.com/name, e.g. habana.ai/gaudi"
        )
    if s.publish_node_facts and not s.node_name:
        problems.append("--publish-node-facts needs --node-name (or NODE_NAME from the downward API)")
    if not s.plugin_dir.is_dir():
        problems.append(
            f"--plugin-dir {s.plugin_dir}: not a directory; mount the kubelet's device-plugins directory there"
        )
    return problems


def _node_publisher(s: DevicePluginSettings, backend):
    from kubetune.cluster.deviceplugin.publish import NodePublisher, PodResourcesClient

    assert s.node_name  # (checked: --publish-node-facts comes with a node name)
    return NodePublisher(
        s.node_name,
        s.resource,
        s.leaf_label,
        PodResourcesClient(s.pod_resources_socket),
        interval=s.publish_interval,
        free_memory=backend.free_memory_mib,
    )


def _dra_vendor(discovery: str, backend) -> str:
    """The DRA vendor (kubetune.contracts.dra.VENDORS key) of a --discovery choice."""
    if discovery == "nvml" or getattr(backend, "vendor", None) == "nvidia":
        return "nvidia"
    return "gaudi"  # sysfs, or an inventory of vendor habana


@with_options(DraDriverSettings, "s", build=True)
def dra_driver(s: DraDriverSettings):
    """Publish this node's cards as ResourceSlices and prepare claims for the kubelet (DRA, Kubernetes 1.34+)."""
    _logging(s.log_level)
    problems = _dra_problems(s)
    if problems:
        raise UserError(*problems)
    assert s.node_name is not None  # (checked above)
    if s.kubeconfig is not None:
        os.environ["KUBECONFIG"] = str(s.kubeconfig)  # kubetune.kubeapi.load_config reads it

    from kubetune.cluster.devices.factory import make_discovery
    from kubetune.cluster.dra.prepare import claim_reader
    from kubetune.cluster.dra.publish import SlicePublisher
    from kubetune.cluster.dra.server import DraDriver
    from kubetune.contracts import dra
    from kubetune.kubeapi import KubeClient

    first_guess = dra.VENDORS["nvidia" if s.discovery == "nvml" else "gaudi"]
    backend = make_discovery(
        s.discovery, first_guess.extended_resource, s.sysfs_root, s.dev_root, wait_for_driver=s.health_interval
    )
    vendor = dra.VENDORS[_dra_vendor(s.discovery, backend)]
    kube = KubeClient()
    driver = DraDriver(
        vendor,
        s.node_name,
        backend,
        SlicePublisher(s.node_name, vendor, kube),
        claim_reader(kube),
        s.registry_dir,
        s.plugins_dir,
        s.cdi_dir,
        s.health_interval,
        s.resync_interval,
    )
    log.info("%s: %d cards via %s on %s", vendor.driver, len(backend.devices()), s.discovery, s.node_name)
    stop = _stop_on_signals()
    driver.start()
    try:
        driver.wait(stop)
    finally:
        driver.stop()


def _dra_problems(s: DraDriverSettings) -> list[str]:
    problems = []
    if not s.node_name:
        problems.append("--node-name is required (or NODE_NAME from the downward API): the slices name the node")
    if min(s.health_interval, s.resync_interval) <= 0:
        problems.append("--health-interval and --resync-interval must be > 0 seconds")
    for flag, path in (("--registry-dir", s.registry_dir), ("--plugins-dir", s.plugins_dir)):
        if not path.is_dir():
            problems.append(f"{flag} {path}: not a directory; mount the kubelet's directory at the same path")
    if s.kubeconfig is not None and not s.kubeconfig.is_file():
        problems.append(f"--kubeconfig {s.kubeconfig}: no such file")
    return problems


@with_options(ExtenderSettings, "s", build=True)
def scheduler_extender(s: ExtenderSettings):
    """Serve the kube-scheduler extender: POST /filter and POST /prioritize."""
    _logging(s.log_level)
    problems = _extender_problems(s)
    if problems:
        raise UserError(*problems)
    from kubetune.cluster.extender.app import ExtenderConfig, create_app
    from kubetune.cluster.extender.policy import Weights
    from kubetune.cluster.extender.server import serve_forever, tune_for_large_bodies

    config = ExtenderConfig(
        resources=s.resource or keys.MANAGED_RESOURCES,
        leaf_labels=s.leaf_label or (keys.LEAF_LABEL,),
        weights=Weights.parse(s.weights) if s.weights else Weights(),
    )
    pods = None
    if s.watch_pods:
        from kubetune.cluster.extender.podcache import PodCache

        pods = PodCache(config.resources, config.leaf_labels)
        pods.start()
    app = create_app(config, pods)
    for change in tune_for_large_bodies():
        log.info("tuned: %s", change)
    log.info("weights %s, resources %s, leaf labels %s", config.weights, config.resources, config.leaf_labels)
    serve_forever(app, s.host, s.port, s.log_level)


def _extender_problems(s: ExtenderSettings) -> list[str]:
    return [f"--port {s.port}: use 1..65535"] if not 0 < s.port < 65536 else []


@with_options(NetprobeSettings, "s", build=True)
def netprobe(s: NetprobeSettings):
    """Measure latency to the other nodes' probers and annotate this node (kubetune.io/rdma-latency-us)."""
    from kubetune.cluster import netprobe as nprobe

    _logging(s.log_level)
    static = [nprobe.parse_peer(p, s.port) for p in s.peer]  # a bad --peer is told first
    problems = _netprobe_problems(s)
    if problems:
        raise UserError(*problems)
    # --once only measures: answering peers is for the long-running prober
    server = None if s.once else nprobe.EchoServer(s.listen, s.port).start()
    use_rdma = s.rdma == "auto" and nprobe.rdma_available()
    rdma_server = nprobe.RdmaServer().start() if use_rdma and not s.once else None
    log.info("netprobe on %s:%d, %s", s.listen, s.port, "rdma (ib_write_lat) + tcp" if use_rdma else "tcp")
    prober = nprobe.Prober(
        s.node_name,
        static,
        s.namespace,
        nprobe.parse_selector(s.selector),
        s.port,
        rdma=use_rdma,
        samples=s.samples,
        timeout=s.timeout,
        max_peers=s.max_peers,
        annotate=s.annotate and not s.serve_only,
    )
    try:
        if s.once:
            typer.echo(json.dumps({"node": s.node_name, **prober.round().as_json()}))
            return
        stop = _stop_on_signals()
        if not s.serve_only:
            threading.Thread(target=prober.run, args=(s.interval,), name="netprobe", daemon=True).start()
        stop.wait()
    finally:
        prober.stop()
        if server:
            server.stop()
        if rdma_server:
            rdma_server.stop()


def _netprobe_problems(s: NetprobeSettings) -> list[str]:
    problems = []
    if not 0 < s.port < 65536:
        problems.append(f"--port {s.port}: use 1..65535")
    if s.interval <= 0 or s.timeout <= 0:
        problems.append("--interval and --timeout must be > 0 seconds")
    if not 1 <= s.samples <= 10000 or s.max_peers < 1:
        problems.append("--samples must be 1..10000 and --max-peers >= 1")
    if s.rdma not in ("auto", "off"):
        problems.append(f"--rdma {s.rdma!r}: use auto or off")
    if s.annotate and not s.serve_only and not s.node_name:
        problems.append("--annotate needs --node-name (or NODE_NAME from the downward API); or pass --no-annotate")
    if not s.peer and not s.serve_only and not s.namespace:
        problems.append("no peers: give --peer HOST[:PORT] or --namespace (POD_NAMESPACE from the downward API)")
    return problems


@with_options(ComponentSettings, "settings", after=("scheduler_config_only", "output"))
def render_components(
    scheduler_config_only: bool = typer.Option(
        False, "--scheduler-config-only", help="Print only the KubeSchedulerConfiguration."
    ),
    output: Path | None = typer.Option(None, "-o", "--output", help="Write to this file instead of stdout."),
    settings: dict[str, Any] | None = None,
):
    """Render the device plugin (or, with --devices dra, the DRA driver and its DeviceClass) and netprobe
    DaemonSets, the extender Deployment/Service, the scheduler config and the Prometheus monitors of the
    plugin and the extender."""
    from kubetune.cluster import manifests

    values = settings or {}
    if values.get("weights"):
        from kubetune.cluster.extender.policy import Weights

        Weights.parse(values["weights"])  # fail here, not in a crash-looping pod
    components = settings_from(ComponentSettings, values)
    objects = [manifests.scheduler_config(components)] if scheduler_config_only else manifests.render(components)
    text = manifests.to_yaml(objects)
    if output:
        output.write_text(text)
        typer.echo(f"wrote {len(objects)} objects to {output}", err=True)
    else:
        typer.echo(text, nl=False)


def register(app: typer.Typer, k8s_app: typer.Typer) -> None:
    app.command("device-plugin")(device_plugin)
    app.command("dra-driver")(dra_driver)
    app.command("scheduler-extender")(scheduler_extender)
    app.command("netprobe")(netprobe)
    k8s_app.command("render-components")(render_components)
