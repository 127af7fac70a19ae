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
from kubetune.cluster.dra import DEFAULT_CDI_DIR, DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR
from kubetune.cluster.extender import DEFAULT_PORT as EXTENDER_PORT
from kubetune.cluster.manifests import ComponentSettings
from kubetune.cluster.netprobe import DEFAULT_PORT as NETPROBE_PORT
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


def device_plugin(
    resource: str = typer.Option(ComponentSettings.resource, "--resource", help="Extended resource to advertise."),
    discovery: str = typer.Option(
        ComponentSettings.discovery, "--discovery", help="sysfs (Gaudi) | nvml (NVIDIA) | inventory:FILE (demo)."
    ),
    plugin_dir: Path = typer.Option(
        Path("/var/lib/kubelet/device-plugins"), "--plugin-dir", help="Directory with kubelet.sock."
    ),
    sysfs_root: Path = typer.Option(
        Path("/sys"), "--sysfs-root", help="Root of the sysfs tree (a fake tree in tests)."
    ),
    dev_root: Path = typer.Option(Path("/dev"), "--dev-root", help="Root of the device nodes probed for health."),
    health_interval: float = typer.Option(5.0, "--health-interval", help="Seconds between health probes."),
    watch_interval: float = typer.Option(
        1.0, "--watch-interval", help="Seconds between looks at the plugin directory."
    ),
    metrics_port: int = typer.Option(0, "--metrics-port", help="Serve Prometheus metrics on this port (0 = off)."),
    publish_node_facts: bool = typer.Option(
        False, "--publish-node-facts", help="Patch this node's annotations/labels (needs RBAC)."
    ),
    node_name: str | None = typer.Option(
        None, "--node-name", envvar="NODE_NAME", help="This node's name (default $NODE_NAME)."
    ),
    leaf_label: str | None = typer.Option(
        None, "--leaf-label", help=f"Node label holding the network leaf; copied to {keys.LEAF_LABEL}."
    ),
    pod_resources_socket: Path = typer.Option(
        Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
        "--pod-resources-socket",
        help="Kubelet PodResources socket (cards in use).",
    ),
    publish_interval: float = typer.Option(30.0, "--publish-interval", help="Seconds between node fact refreshes."),
    log_level: str = typer.Option("info", "--log-level"),
):
    """Advertise whole accelerator cards to the kubelet (device plugin API v1beta1)."""
    _logging(log_level)
    if health_interval <= 0 or watch_interval <= 0 or publish_interval <= 0:
        raise UserError("--health-interval, --watch-interval and --publish-interval must be > 0 seconds")
    if "/" not in resource:
        raise UserError(
            f"--resource {resource!r}: an extended resource looks like vendor.com/name, e.g. habana.ai/gaudi"
        )
    if publish_node_facts and not node_name:
        raise UserError("--publish-node-facts needs --node-name (or NODE_NAME from the downward API)")
    if not plugin_dir.is_dir():
        raise UserError(
            f"--plugin-dir {plugin_dir}: not a directory; mount the kubelet's device-plugins directory there"
        )

    from kubetune.cluster.deviceplugin.server import DevicePlugin
    from kubetune.cluster.devices.factory import make_discovery

    # A node without the driver (or without cards) keeps the pod running with 0 cards advertised,
    # as the vendor plugins do; only a broken image or bad flags end the process.
    backend = make_discovery(discovery, resource, sysfs_root, dev_root, wait_for_driver=health_interval)
    publisher = None
    if publish_node_facts and node_name:  # (checked above: --publish-node-facts comes with a node name)
        from kubetune.cluster.deviceplugin.publish import NodePublisher, PodResourcesClient

        publisher = NodePublisher(
            node_name,
            resource,
            leaf_label,
            PodResourcesClient(pod_resources_socket),
            interval=publish_interval,
            free_memory=backend.free_memory_mib,
        )
    plugin = DevicePlugin(
        backend,
        plugin_dir,
        health_interval=health_interval,
        watch_interval=watch_interval,
        on_change=publisher.hook if publisher else None,
    )
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, registry=plugin.metrics.registry)
    if publisher:
        threading.Thread(target=publisher.run, args=(plugin.state,), name="node-facts", daemon=True).start()
    log.info("%s: %d cards via %s", resource, len(backend.devices()), discovery)
    stop = _stop_on_signals()
    try:
        plugin.run(stop)
    finally:
        if publisher:
            publisher.stop()
        plugin.stop()


def _dra_vendor(discovery: str, backend) -> str:
    """The DRA vendor (kubetune.contracts.dra.VENDORS key) of a --discovery choice."""
    if discovery == "nvml" or getattr(backend, "vendor", None) == "nvidia":
        return "nvidia"
    return "gaudi"  # sysfs, or an inventory of vendor habana


def dra_driver(
    discovery: str = typer.Option(
        ComponentSettings.discovery, "--discovery", help="sysfs (Gaudi) | nvml (NVIDIA) | inventory:FILE (demo)."
    ),
    node_name: str | None = typer.Option(
        None, "--node-name", envvar="NODE_NAME", help="This node's name (default $NODE_NAME)."
    ),
    registry_dir: Path = typer.Option(
        DEFAULT_REGISTRY_DIR, "--registry-dir", help="The kubelet's plugin registry directory."
    ),
    plugins_dir: Path = typer.Option(
        DEFAULT_PLUGINS_DIR, "--plugins-dir", help="Parent of the driver's own directory."
    ),
    cdi_dir: Path = typer.Option(DEFAULT_CDI_DIR, "--cdi-dir", help="Where the CDI spec files are written."),
    kubeconfig: Path | None = typer.Option(
        None, "--kubeconfig", help="Kubeconfig file (default: $KUBECONFIG, else the pod's service account)."
    ),
    sysfs_root: Path = typer.Option(Path("/sys"), "--sysfs-root", help="Root of the sysfs tree (a fake in tests)."),
    dev_root: Path = typer.Option(Path("/dev"), "--dev-root", help="Root of the device nodes probed for health."),
    health_interval: float = typer.Option(5.0, "--health-interval", help="Seconds between health probes."),
    resync_interval: float = typer.Option(
        60.0, "--resync-interval", help="Seconds between checks that this node's ResourceSlices are still there."
    ),
    log_level: str = typer.Option("info", "--log-level"),
):
    """Publish this node's cards as ResourceSlices and prepare claims for the kubelet (DRA, Kubernetes 1.34+)."""
    _logging(log_level)
    problems = _dra_problems(node_name, registry_dir, plugins_dir, kubeconfig, min(health_interval, resync_interval))
    if problems:
        raise UserError(*problems)
    assert node_name is not None  # (checked above)
    if kubeconfig is not None:
        os.environ["KUBECONFIG"] = str(kubeconfig)  # kubetune.contracts.kube.load_config reads it

    from kubernetes import client

    from kubetune.cluster.devices.factory import make_discovery
    from kubetune.cluster.dra.prepare import claim_reader
    from kubetune.cluster.dra.publish import SliceApi, SlicePublisher
    from kubetune.cluster.dra.server import DraDriver
    from kubetune.contracts import dra
    from kubetune.contracts.kube import load_config

    first_guess = dra.VENDORS["nvidia" if discovery == "nvml" else "gaudi"]
    backend = make_discovery(
        discovery, first_guess.extended_resource, sysfs_root, dev_root, wait_for_driver=health_interval
    )
    vendor = dra.VENDORS[_dra_vendor(discovery, backend)]
    api_client = client.ApiClient(load_config())
    driver = DraDriver(
        vendor,
        node_name,
        backend,
        SlicePublisher(node_name, vendor, SliceApi(api_client)),
        claim_reader(api_client),
        registry_dir,
        plugins_dir,
        cdi_dir,
        health_interval,
        resync_interval,
    )
    log.info("%s: %d cards via %s on %s", vendor.driver, len(backend.devices()), discovery, node_name)
    stop = _stop_on_signals()
    driver.start()
    try:
        driver.wait(stop)
    finally:
        driver.stop()


def _dra_problems(node_name, registry_dir, plugins_dir, kubeconfig, interval) -> list[str]:
    problems = []
    if not node_name:
        problems.append("--node-name is required (or NODE_NAME from the downward API): the slices name the node")
    if interval <= 0:
        problems.append("--health-interval and --resync-interval must be > 0 seconds")
    for flag, path in (("--registry-dir", registry_dir), ("--plugins-dir", plugins_dir)):
        if not path.is_dir():
            problems.append(f"{flag} {path}: not a directory; mount the kubelet's directory at the same path")
    if kubeconfig is not None and not kubeconfig.is_file():
        problems.append(f"--kubeconfig {kubeconfig}: no such file")
    return problems


def scheduler_extender(
    host: str = typer.Option("0.0.0.0", "--host"),
    port: int = typer.Option(EXTENDER_PORT, "--port"),
    weights: str = typer.Option("", "--weights", help="Score weights, e.g. fit=3,hbm=1,closeness=5,rdma=1."),
    resource: list[str] | None = typer.Option(
        None, "--resource", help="Managed resources (repeatable; default habana.ai/gaudi, nvidia.com/gpu)."
    ),
    leaf_label: list[str] | None = typer.Option(
        None, "--leaf-label", help=f"Node labels naming the network leaf, in order (default {keys.LEAF_LABEL})."
    ),
    watch_pods: bool = typer.Option(
        False, "--watch-pods", help="Keep a watch-backed pod cache (needs list/watch on pods and nodes)."
    ),
    log_level: str = typer.Option("info", "--log-level"),
):
    """Serve the kube-scheduler extender: POST /filter and POST /prioritize."""
    _logging(log_level)
    if not 0 < port < 65536:
        raise UserError(f"--port {port}: use 1..65535")
    from kubetune.cluster.extender.app import ExtenderConfig, create_app
    from kubetune.cluster.extender.policy import Weights
    from kubetune.cluster.extender.server import serve_forever, tune_for_large_bodies

    config = ExtenderConfig(
        resources=tuple(resource or keys.MANAGED_RESOURCES),
        leaf_labels=tuple(leaf_label or (keys.LEAF_LABEL,)),
        weights=Weights.parse(weights) if weights else Weights(),
    )
    pods = None
    if watch_pods:
        from kubetune.cluster.extender.podcache import PodCache

        pods = PodCache(config.resources, config.leaf_labels)
        pods.start()
    app = create_app(config, pods)
    for change in tune_for_large_bodies():
        log.info("tuned: %s", change)
    log.info("weights %s, resources %s, leaf labels %s", config.weights, config.resources, config.leaf_labels)
    serve_forever(app, host, port, log_level)


def netprobe(
    node_name: str | None = typer.Option(
        None, "--node-name", envvar="NODE_NAME", help="This node's name (default $NODE_NAME)."
    ),
    listen: str = typer.Option("0.0.0.0", "--listen", help="Address the echo server answers peers on."),
    port: int = typer.Option(NETPROBE_PORT, "--port", help="TCP port of the echo server (the same on every node)."),
    peer: list[str] | None = typer.Option(
        None, "--peer", help="HOST[:PORT] to measure (repeatable); default: the DaemonSet's other pods, from the API."
    ),
    namespace: str | None = typer.Option(
        None, "--namespace", envvar="POD_NAMESPACE", help="Namespace of the prober pods (default $POD_NAMESPACE)."
    ),
    selector: str = typer.Option(
        "app.kubernetes.io/name=kubetune-netprobe", "--selector", help="Labels of the prober pods."
    ),
    interval: float = typer.Option(60.0, "--interval", help="Seconds between measurement rounds."),
    samples: int = typer.Option(20, "--samples", help="TCP ping-pongs per peer and round."),
    max_peers: int = typer.Option(16, "--max-peers", help="Peers measured per round (a random sample of them)."),
    timeout: float = typer.Option(1.0, "--timeout", help="Seconds to wait for a peer's answer."),
    rdma: str = typer.Option("auto", "--rdma", help="auto: ib_write_lat when perftest and an RDMA device exist; off."),
    annotate: bool = typer.Option(
        True, "--annotate/--no-annotate", help="Write the result on this node's Node object (needs RBAC)."
    ),
    serve_only: bool = typer.Option(False, "--serve-only", help="Only answer other probers; measure nothing."),
    once: bool = typer.Option(False, "--once", help="One round: print it as JSON (and annotate), then exit."),
    log_level: str = typer.Option("info", "--log-level"),
):
    """Measure latency to the other nodes' probers and annotate this node (kubetune.io/rdma-latency-us)."""
    from kubetune.cluster import netprobe as nprobe

    _logging(log_level)
    problems = _netprobe_problems(node_name, port, interval, samples, max_peers, timeout, rdma, annotate, serve_only)
    static = [nprobe.parse_peer(p, port) for p in peer or []]
    if not static and not serve_only and not namespace:
        problems.append("no peers: give --peer HOST[:PORT] or --namespace (POD_NAMESPACE from the downward API)")
    if problems:
        raise UserError(*problems)
    # --once only measures: answering peers is for the long-running prober
    server = None if once else nprobe.EchoServer(listen, port).start()
    use_rdma = rdma == "auto" and nprobe.rdma_available()
    rdma_server = nprobe.RdmaServer().start() if use_rdma and not once else None
    log.info("netprobe on %s:%d, %s", listen, port, "rdma (ib_write_lat) + tcp" if use_rdma else "tcp")
    prober = nprobe.Prober(
        node_name,
        static,
        namespace,
        nprobe.parse_selector(selector),
        port,
        rdma=use_rdma,
        samples=samples,
        timeout=timeout,
        max_peers=max_peers,
        annotate=annotate and not serve_only,
    )
    try:
        if once:
            typer.echo(json.dumps({"node": node_name, **prober.round().as_json()}))
            return
        stop = _stop_on_signals()
        if not serve_only:
            threading.Thread(target=prober.run, args=(interval,), name="netprobe", daemon=True).start()
        stop.wait()
    finally:
        prober.stop()
        if server:
            server.stop()
        if rdma_server:
            rdma_server.stop()


def _netprobe_problems(node_name, port, interval, samples, max_peers, timeout, rdma, annotate, serve_only) -> list:
    problems = []
    if not 0 < port < 65536:
        problems.append(f"--port {port}: use 1..65535")
    if interval <= 0 or timeout <= 0:
        problems.append("--interval and --timeout must be > 0 seconds")
    if not 1 <= samples <= 10000 or max_peers < 1:
        problems.append("--samples must be 1..10000 and --max-peers >= 1")
    if rdma not in ("auto", "off"):
        problems.append(f"--rdma {rdma!r}: use auto or off")
    if annotate and not serve_only and not node_name:
        problems.append("--annotate needs --node-name (or NODE_NAME from the downward API); or pass --no-annotate")
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
