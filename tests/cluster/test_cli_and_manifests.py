"""The commands as the DaemonSet / Deployment run them (real processes), and the rendered manifests."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from kubetune.k8s.validate import validate_objects
from kubetune.netutil import free_port, http_answers, wait_ready

from .fakes import FakeKubelet, hls_box, make_gaudi_tree
from .samples import extender_args, gaudi_node, training_pod

pytestmark = pytest.mark.process

KUBETUNE = [sys.executable, "-m", "kubetune"]


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 20) -> None:
    """Until `url` answers at all (a health check may still say 503: the tests read it)."""
    wait_ready(functools.partial(http_answers, url), timeout, process=proc, interval=0.05, name=url)


def test_device_plugin_command_registers_serves_metrics_and_stops_cleanly(tmp_path, plugin_dir):
    sysfs, dev = make_gaudi_tree(tmp_path / "node", hls_box("0x1060", 4))
    kubelet = FakeKubelet(plugin_dir).start()
    port = free_port()
    proc = subprocess.Popen(
        KUBETUNE
        + [
            "device-plugin",
            "--discovery",
            "sysfs",
            "--sysfs-root",
            str(sysfs),
            "--dev-root",
            str(dev),
            "--plugin-dir",
            str(plugin_dir),
        ]
        + [
            "--health-interval",
            "0.1",
            "--watch-interval",
            "0.1",
            "--metrics-port",
            str(port),
            "--log-level",
            "warning",
        ],
        stderr=subprocess.PIPE,
    )
    try:
        req = kubelet.requests.get(timeout=20)
        assert req.resource_name == "habana.ai/gaudi" and (plugin_dir / req.endpoint).exists()
        _wait_http(f"http://127.0.0.1:{port}/metrics", proc)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'kubetune_deviceplugin_devices{health="Healthy",resource="habana.ai/gaudi"} 4.0' in metrics
        assert _stop(proc) == 0
        assert not (plugin_dir / req.endpoint).exists()  # socket removed on SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
        kubelet.stop()


def test_device_plugin_command_on_a_node_without_the_driver_keeps_running_with_zero_cards(tmp_path, plugin_dir):
    # what the DaemonSet's pod does on a node whose driver is absent: before, it exited 2 and crash-looped
    (tmp_path / "sys").mkdir()  # a sysfs without bus/pci/drivers/habanalabs
    kubelet = FakeKubelet(plugin_dir).start()
    port = free_port()
    flags = ["--sysfs-root", str(tmp_path / "sys"), "--plugin-dir", str(plugin_dir), "--metrics-port", str(port)]
    proc = subprocess.Popen(
        KUBETUNE + ["device-plugin", *flags, "--health-interval", "0.1", "--log-level", "warning"],
        stderr=subprocess.PIPE,
    )
    try:
        assert kubelet.requests.get(timeout=20).resource_name == "habana.ai/gaudi"
        _wait_http(f"http://127.0.0.1:{port}/metrics", proc)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'kubetune_deviceplugin_driver_present{resource="habana.ai/gaudi"} 0.0' in metrics
        assert 'kubetune_deviceplugin_devices{health="Healthy",resource="habana.ai/gaudi"} 0.0' in metrics
        time.sleep(0.5)  # several driver checks later: still up
        assert proc.poll() is None
        assert _stop(proc) == 0
        log = proc.stderr.read().decode()
        assert log.count("no cards to advertise") == 1, log  # one line for the state, not one per check
        assert "habanalabs" in log and "--node-selector" in log
    finally:
        if proc.poll() is None:
            proc.kill()
        kubelet.stop()


def test_device_plugin_command_bad_flags_exit_2_with_one_line(tmp_path):
    r = subprocess.run(
        KUBETUNE + ["device-plugin", "--discovery", "pci", "--plugin-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (
        r.returncode == 2
        and r.stderr.strip() == "kubetune: error: --discovery 'pci': use sysfs, nvml or inventory:FILE"
    )


def test_scheduler_extender_command_answers_filter(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        KUBETUNE
        + [
            "scheduler-extender",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--weights",
            "fit=1",
            "--log-level",
            "warning",
        ],
        stderr=subprocess.PIPE,
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/healthz", proc)
        body = extender_args(training_pod(cards=8), [gaudi_node("a", free=8), gaudi_node("b", free=2)])
        r = httpx.post(f"http://127.0.0.1:{port}/filter", json=body, timeout=10)
        assert r.status_code == 200 and list(r.json()["FailedNodes"]) == ["b"]
        # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit shows the signal
        assert _stop(proc) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()


def _render(*flags) -> list[dict]:
    r = subprocess.run(KUBETUNE + ["k8s", "render-components", *flags], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.mark.parametrize(
    "flags",
    [
        [],
        [
            "--stateless",
            "--discovery",
            "nvml",
            "--resource",
            "nvidia.com/gpu",
            "--leaf-label",
            "topology.kubernetes.io/rack",
        ],
        ["--node-selector", "example.com/accelerator=gaudi3", "--node-selector", "pool=train"],
        ["--all-nodes"],
    ],
)
def test_rendered_manifests_validate_strictly(flags):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objects = _render(*flags)
    kinds = [o["kind"] for o in objects]
    assert kinds.count("DaemonSet") == 2 and kinds.count("Deployment") == 1 and kinds.count("Service") == 1
    assert kinds.count("Role") == 1  # the prober lists the pods of its own namespace only
    assert kinds.count("PodMonitor") == 1 and kinds.count("ServiceMonitor") == 1
    for obj in objects:
        if obj["kind"] in ("PodMonitor", "ServiceMonitor"):  # the vendored Prometheus Operator CRDs
            assert validate_objects([obj]) == []
        else:
            kubernetes_validate.validate(obj, "1.33.0", strict=True)  # raises on any unknown or wrong field
    ds = next(o for o in objects if o["kind"] == "DaemonSet" and "device" in o["metadata"]["name"])
    ds = ds["spec"]["template"]["spec"]
    assert ds["priorityClassName"] == "system-node-critical"
    assert ds["containers"][0]["securityContext"]["privileged"] is True
    assert {"path": "/var/lib/kubelet/device-plugins", "type": "Directory"} in [v["hostPath"] for v in ds["volumes"]]
    role = next(o for o in objects if o["kind"] == "ClusterRole" and "device-plugin" in o["metadata"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]


def test_monitors_select_the_components_on_their_metrics_ports():
    objects = _render("--release", "prom", "-n", "ops")
    plugin = next(o for o in objects if o["kind"] == "DaemonSet" and "device" in o["metadata"]["name"])
    extender = next(o for o in objects if o["kind"] == "Service")
    pod_monitor = next(o for o in objects if o["kind"] == "PodMonitor")
    service_monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    for monitor in (pod_monitor, service_monitor):
        assert monitor["metadata"]["labels"]["release"] == "prom" and monitor["metadata"]["namespace"] == "ops"
    selected = pod_monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= plugin["spec"]["template"]["metadata"]["labels"].items()
    port = pod_monitor["spec"]["podMetricsEndpoints"][0]["port"]
    assert port in [p["name"] for p in plugin["spec"]["template"]["spec"]["containers"][0]["ports"]]
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= extender["metadata"]["labels"].items()
    assert service_monitor["spec"]["endpoints"][0]["port"] in [p["name"] for p in extender["spec"]["ports"]]
    assert not [o for o in _render("--no-monitors") if o["kind"].endswith("Monitor")]


def test_validation_is_strict_enough_to_fail():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    ds = next(o for o in _render() if o["kind"] == "DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["privilegd"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, "1.33.0", strict=True)


def test_scheduler_config_extender_entry():
    (config,) = _render("--scheduler-config-only", "--extender-weight", "7", "-n", "sched")
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1" and config["kind"] == "KubeSchedulerConfiguration"
    assert config["percentageOfNodesToScore"] == 100
    (entry,) = config["extenders"]
    assert entry == {
        "urlPrefix": "http://kubetune-scheduler-extender.sched.svc:8888",
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "weight": 7,
        "enableHTTPS": False,
        "httpTimeout": "5s",
        "nodeCacheCapable": True,  # the extender watches the nodes (`--watch-pods`, the default)
        "managedResources": [
            {"name": "habana.ai/gaudi", "ignoredByScheduler": False},
            {"name": "nvidia.com/gpu", "ignoredByScheduler": False},
        ],
        "ignorable": True,
    }
    cm = next(o for o in _render() if o["kind"] == "ConfigMap")
    assert yaml.safe_load(cm["data"]["kube-scheduler-config.yaml"])["extenders"][0]["weight"] == 5


def test_a_custom_resource_reaches_the_plugin_the_extender_and_the_scheduler():
    # a plugin advertising habana.ai/gaudi-mm is no use if the extender and the scheduler ignore it
    mm = "habana.ai/gaudi-mm"
    objects = _render("--resource", mm, "--stateless", "--no-netprobe")
    plugin = next(o for o in objects if o["kind"] == "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert plugin["args"][plugin["args"].index("--resource") + 1] == mm
    cm = next(o for o in objects if o["kind"] == "ConfigMap")
    (entry,) = yaml.safe_load(cm["data"]["kube-scheduler-config.yaml"])["extenders"]
    assert {"name": mm, "ignoredByScheduler": False} in entry["managedResources"]
    args = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    # the extender as rendered (on loopback): it must filter on the custom resource's free cards
    port = free_port()
    at = {"--host": "127.0.0.1", "--port": str(port)}
    local = [at.get(prev, arg) for prev, arg in zip(["", *args[:-1]], args, strict=True)]
    proc = subprocess.Popen(KUBETUNE + [*local, "--log-level", "warning"], stderr=subprocess.PIPE)
    try:
        _wait_http(f"http://127.0.0.1:{port}/healthz", proc)
        nodes = [gaudi_node("a", free=8, resource=mm), gaudi_node("b", free=2, resource=mm)]
        body = extender_args(training_pod(cards=8, resource=mm), nodes)
        r = httpx.post(f"http://127.0.0.1:{port}/filter", json=body, timeout=10)
        assert r.status_code == 200 and list(r.json()["FailedNodes"]) == ["b"]
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_render_rejects_bad_settings_naming_the_flags():
    r = subprocess.run(
        KUBETUNE + ["k8s", "render-components", "--extender-weight", "0", "--discovery", "inventory:x.yaml"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert "--extender-weight 0" in r.stderr and "--discovery inventory" in r.stderr


def test_cluster_layer_does_not_import_training_or_torch():
    code = (
        "import sys, kubetune.cluster.cli, kubetune.cluster.manifests, kubetune.cluster.extender.app, "
        "kubetune.cluster.deviceplugin.server, kubetune.cluster.deviceplugin.publish, "
        "kubetune.cluster.extender.podcache; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('kubetune.training')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert r.returncode == 0, r.stdout + r.stderr


def _plugin_pod(*flags) -> dict:
    return next(o for o in _render(*flags) if o["kind"] == "DaemonSet")["spec"]["template"]["spec"]


def _nfd_keys(pod: dict) -> list[str]:
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all(len(t["matchExpressions"]) == 1 for t in terms)  # ORed terms: any one label is enough
    assert {(e["operator"], tuple(e["values"])) for t in terms for e in t["matchExpressions"]} == {("In", ("true",))}
    return [t["matchExpressions"][0]["key"] for t in terms]


def test_device_plugin_runs_only_on_nodes_nfd_saw_the_vendors_cards_on():
    # NFD labels pci-<class>_<vendor>.present by default, pci-<vendor>.present with deviceLabelFields: [vendor]
    gaudi = _plugin_pod()
    assert _nfd_keys(gaudi) == [
        "feature.node.kubernetes.io/pci-1200_1da3.present",
        "feature.node.kubernetes.io/pci-1da3.present",
    ]
    assert "nodeSelector" not in gaudi and "NVIDIA_DRIVER_CAPABILITIES" not in str(gaudi)
    nvidia = _plugin_pod("--discovery", "nvml", "--resource", "nvidia.com/gpu")
    assert _nfd_keys(nvidia) == [
        "feature.node.kubernetes.io/pci-0302_10de.present",
        "feature.node.kubernetes.io/pci-0300_10de.present",
        "feature.node.kubernetes.io/pci-10de.present",
    ]
    env = {e["name"]: e.get("value") for e in nvidia["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"


def test_node_selection_is_overridable():
    picked = _plugin_pod("--node-selector", "example.com/accelerator=gaudi3", "--node-selector", "pool=a=b")
    assert picked["nodeSelector"] == {"example.com/accelerator": "gaudi3", "pool": "a=b"} and "affinity" not in picked
    everywhere = _plugin_pod("--all-nodes")
    assert "nodeSelector" not in everywhere and "affinity" not in everywhere


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--node-selector", "gaudi"], "kubetune: error: --node-selector 'gaudi': use KEY=VALUE, e.g. "),
        (["--node-selector", "=true"], "kubetune: error: --node-selector '=true': use KEY=VALUE, e.g. "),
        (["--node-selector", "a=b", "--all-nodes"], "kubetune: error: --node-selector and --all-nodes exclude"),
        (["--discovery", "pci"], "kubetune: error: --discovery 'pci': use sysfs (Gaudi) or nvml (NVIDIA)"),
    ],
)
def test_bad_node_selection_is_one_line_naming_the_flag(flags, line):
    r = subprocess.run(KUBETUNE + ["k8s", "render-components", *flags], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(line), r.stderr


def test_with_the_dra_driver_the_scheduler_sends_every_pod_to_the_extender():
    # claim pods request no extended resource: a managedResources list would keep them from the extender
    (config,) = _render("--scheduler-config-only", "--devices", "dra", "--kubernetes-version", "1.34")
    (entry,) = config["extenders"]
    assert "managedResources" not in entry and entry["filterVerb"] == "filter"
