"""The cluster components of the kubetune-operator chart equal `kubetune k8s render-components`.

The chart's templates are written by hand (readable Helm, values a user can set); these tests hold them equal,
object by object, to kubetune.cluster.manifests, the one source both `render-components` and the chart answer
to, for settings that take every branch of manifests.py: either vendor's discovery, NFD placement, a node
selector, every node, a leaf label, weights, a stateless extender, the prober off, the monitors off or with another
release label, other ports, namespace and image.

What is compared is what a user sees and sets: the chart's object names start with the release's name, and
`fullnameOverride: kubetune` makes them render-components' names; the labels Helm's conventions add (the release,
versions, the managing tool: helm.HELM_LABELS) are left out of the comparison, and tested with the chart's own
(tests/charts/test_operator_chart.py).
"""

from __future__ import annotations

import dataclasses

import helm_python
import pytest
import yaml

from kubetune.cluster import manifests
from kubetune.cluster.manifests import ComponentSettings
from kubetune.errors import UserError
from tests.kit.cli import run_cli_redirected

from .helm import OPERATOR_CHART, by_key, render, without_helm_labels

# The templates that hold the components (operator.yaml holds the operator; tests/charts/test_operator_chart.py)
COMPONENT_TEMPLATES = {
    "device-plugin.yaml": "devicePlugin",
    "scheduler-extender.yaml": "schedulerExtender",
    "netprobe.yaml": "netprobe",
}

# ComponentSettings field -> (path in the chart's values, how the value is written there)
VALUES = {
    "namespace": None,  # the release's namespace (`helm install -n`)
    "image": (("image",), lambda image: dict(zip(("repository", "tag"), image.rpartition(":")[::2], strict=True))),
    "resource": (("resource",), str),
    "discovery": (("discovery",), str),
    "node_selector": (("nodeSelector",), lambda items: dict(i.split("=", 1) for i in items)),
    "all_nodes": (("allNodes",), bool),
    "leaf_label": (("devicePlugin", "leafLabel"), lambda v: v or ""),
    "metrics_port": (("devicePlugin", "metricsPort"), int),
    "extender_port": (("schedulerExtender", "port"), int),
    "extender_weight": (("schedulerExtender", "weight"), int),
    "weights": (("schedulerExtender", "weights"), str),
    "watch_pods": (("schedulerExtender", "watchPods"), bool),
    "netprobe": (("netprobe", "enabled"), bool),
    "netprobe_port": (("netprobe", "port"), int),
    "monitors": (("monitors", "enabled"), bool),
    "release": (("monitors", "release"), str),
    "devices": (("draDriver", "enabled"), lambda devices: devices == "dra"),  # tests/cluster/test_dra_chart.py
    "kubernetes_version": None,  # Helm's .Capabilities.KubeVersion: the cluster's own
}

CASES = {
    "defaults": ComponentSettings(),
    "nvidia-selector-stateless": ComponentSettings(
        namespace="gpu-system",
        image="registry.example.com/kubetune:0.2.0-cuda",
        resource="nvidia.com/gpu",
        discovery="nvml",
        leaf_label="topology.kubernetes.io/rack",
        extender_port=9999,
        extender_weight=100,
        weights="fit=3,hbm=1.5,closeness=5,rdma=0",
        watch_pods=False,
        metrics_port=9500,
        node_selector=("pool=gpu", "example.com/tier=a"),
        netprobe=False,
        release="prometheus",
    ),
    "gaudi-every-node": ComponentSettings(
        namespace="ops", all_nodes=True, netprobe_port=7000, extender_weight=1, monitors=False
    ),
    "nvidia-nfd": ComponentSettings(resource="nvidia.com/gpu", discovery="nvml", weights="closeness=9"),
    # a resource of the plugin's own: the extender scores it and the scheduler configuration sends it
    "gaudi-own-resource": ComponentSettings(resource="habana.ai/gaudi-mm", leaf_label="rack"),
}


def chart_values(s: ComponentSettings, devicePlugin: bool = True, schedulerExtender: bool = True) -> dict:
    """The chart's values for these settings; the three components on, as render-components renders them."""
    components: dict = {"devicePlugin": {"enabled": devicePlugin}, "schedulerExtender": {"enabled": schedulerExtender}}
    for field, spec in VALUES.items():
        if spec is None:
            continue
        path, convert = spec
        section = components
        for part in path[:-1]:
            section = section.setdefault(part, {})
        section[path[-1]] = convert(getattr(s, field))
    # the names render-components prints (kubetune-device-plugin, ...): the chart's are FULLNAME-device-plugin
    return {"components": components, "fullnameOverride": "kubetune"}


def chart_components(values: dict, namespace: str) -> list[dict]:
    rendered = render(OPERATOR_CHART, values, namespace=namespace)
    components = [objs for path, objs in rendered.items() if path.rsplit("/", 1)[-1] in COMPONENT_TEMPLATES]
    return [without_helm_labels(obj) for objs in components for obj in objs]


def assert_same_objects(chart_objs: list[dict], expected: list[dict]) -> None:
    """The same objects, each equal as data. Order aside: Helm sorts what it installs by kind itself."""
    ours, theirs = by_key(chart_objs), by_key(expected)
    assert sorted(ours) == sorted(theirs)
    for k, obj in theirs.items():
        # The scheduler reads its configuration as YAML: compare the text exactly as render-components writes it
        # (the equality of the ConfigMaps below would also hold for text that only parses the same)
        if obj["kind"] == "ConfigMap":
            assert ours[k]["data"] == obj["data"], k
        assert ours[k] == obj, k


def test_every_setting_of_render_components_is_a_chart_value():
    # a new ComponentSettings field must reach the chart too: this fails until VALUES (and the chart) map it
    assert {f.name for f in dataclasses.fields(ComponentSettings)} == set(VALUES)


@pytest.mark.parametrize("case", CASES)
def test_the_chart_renders_what_render_components_renders(case):
    s = CASES[case]
    assert_same_objects(chart_components(chart_values(s), s.namespace), manifests.render(s))


def test_the_chart_equals_the_render_components_command():
    # through the CLI's flags, not only manifests.render: the flag -> setting mapping is checked too
    s = CASES["nvidia-selector-stateless"]
    result = run_cli_redirected(
        "k8s", "render-components", "-n", s.namespace, "--image", s.image, "--resource", s.resource,
        "--discovery", s.discovery, "--leaf-label", str(s.leaf_label), "--extender-port", str(s.extender_port),
        "--extender-weight", str(s.extender_weight), "--weights", s.weights, "--stateless",
        "--node-selector", s.node_selector[0], "--node-selector", s.node_selector[1], "--no-netprobe",
        "--release", s.release,
    )  # fmt: skip
    assert result.code == 0, result.err
    printed = [obj for obj in yaml.safe_load_all(result.out) if obj]
    # metrics_port is a ComponentSettings field without a flag: the command renders its default
    values = chart_values(dataclasses.replace(s, metrics_port=ComponentSettings.metrics_port))
    assert_same_objects(chart_components(values, s.namespace), printed)


@pytest.mark.parametrize("component", COMPONENT_TEMPLATES.values())
def test_each_component_alone_renders_only_its_own_objects(component):
    s = ComponentSettings(netprobe=component == "netprobe")
    values = chart_values(
        s, devicePlugin=component == "devicePlugin", schedulerExtender=component == "schedulerExtender"
    )
    plugin_monitor, extender_monitor = manifests.component_monitors(s)  # each goes with its component
    expected = {
        "devicePlugin": manifests.device_plugin(s) + [plugin_monitor],
        "schedulerExtender": manifests.extender(s) + [manifests.scheduler_config_map(s), extender_monitor],
        "netprobe": manifests.netprobe(s),
    }[component]
    assert_same_objects(chart_components(values, s.namespace), expected)


def test_no_component_is_rendered_by_default():
    assert chart_components({}, "kubetune-system") == []


# (what ComponentSettings is given, the same mistake in the chart's values): both refuse it
REFUSED = {
    "discovery inventory": ({"discovery": "inventory:/tmp/cards.json"}, {"discovery": "inventory:/tmp/cards.json"}),
    "discovery unknown": ({"discovery": "rocm"}, {"discovery": "rocm"}),
    "resource without vendor": ({"resource": "gaudi"}, {"resource": "gaudi"}),
    "weight 0": ({"extender_weight": 0}, {"schedulerExtender": {"weight": 0}}),
    "weight 101": ({"extender_weight": 101}, {"schedulerExtender": {"weight": 101}}),
    "port 0": ({"extender_port": 0}, {"schedulerExtender": {"port": 0}}),
    "netprobe port 70000": ({"netprobe_port": 70000}, {"netprobe": {"port": 70000}}),
    "selector and every node": (
        {"node_selector": ("pool=gpu",), "all_nodes": True},
        {"nodeSelector": {"pool": "gpu"}, "allNodes": True},
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_the_chart_refuses_what_render_components_refuses(case):
    settings, values = REFUSED[case]
    with pytest.raises(UserError):
        ComponentSettings(**settings)
    with pytest.raises(helm_python.HelmValuesError):
        render(OPERATOR_CHART, {"components": {**values, "devicePlugin": {"enabled": True}}})


@pytest.mark.parametrize("weights", ["fit=3,foo=1", "fit=x", "fit=-1"])
def test_the_chart_refuses_weights_the_extender_refuses(weights):
    from kubetune.cluster.extender.policy import Weights

    with pytest.raises(UserError):
        Weights.parse(weights)
    with pytest.raises(helm_python.HelmValuesError):
        render(OPERATOR_CHART, {"components": {"schedulerExtender": {"enabled": True, "weights": weights}}})


def test_every_weight_name_of_the_extender_is_accepted():
    from kubetune.cluster.extender.policy import Weights

    names = [f.name for f in dataclasses.fields(Weights)]
    weights = ",".join(f"{n}=2" for n in names)
    render(OPERATOR_CHART, {"components": {"schedulerExtender": {"enabled": True, "weights": weights}}})


def test_a_misspelt_value_is_refused():
    with pytest.raises(helm_python.HelmValuesError, match="enable"):
        render(OPERATOR_CHART, {"components": {"devicePlugin": {"enable": True}}})
