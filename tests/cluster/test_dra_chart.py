"""The operator chart's DRA driver (components.draDriver) equals `render-components --devices dra`, and
refuses what it refuses: a cluster before 1.34, and the device plugin beside it."""

from __future__ import annotations

import helm_python
import pytest

from kubetune.cluster import manifests
from kubetune.cluster.manifests import ComponentSettings

from ..charts.helm import OPERATOR_CHART, by_key, installed, objects, render, without_helm_labels
from ..charts.test_components_chart import chart_values

CASES = {
    "gaudi": ComponentSettings(devices="dra"),
    "nvidia-selector": ComponentSettings(
        devices="dra", discovery="nvml", resource="nvidia.com/gpu", node_selector=("pool=gpu",), namespace="gpu"
    ),
    "every-node": ComponentSettings(devices="dra", all_nodes=True, image="registry.example.com/kubetune:1.0"),
}


def _dra_values(s: ComponentSettings) -> dict:
    values = chart_values(s, devicePlugin=False, schedulerExtender=False)
    values["components"]["netprobe"]["enabled"] = False
    return values


@pytest.mark.parametrize("case", CASES)
def test_the_chart_renders_the_dra_driver_render_components_renders(case):
    s = CASES[case]
    rendered = render(OPERATOR_CHART, _dra_values(s), namespace=s.namespace)
    chart_objs = [
        without_helm_labels(o) for path, objs in rendered.items() if path.endswith("/dra-driver.yaml") for o in objs
    ]
    ours, theirs = by_key(chart_objs), by_key(manifests.dra_driver(s))
    assert sorted(ours) == sorted(theirs)
    for k, obj in theirs.items():
        assert ours[k] == obj, k


def test_the_chart_is_lint_clean_and_refuses_old_clusters_and_two_device_components(capfd):
    values = _dra_values(CASES["gaudi"])
    assert helm_python.lint(str(OPERATOR_CHART), values, strict=True, namespace="kubetune-system")["errors"] == []
    assert "fail message" not in capfd.readouterr().err
    # the only way to give the engine a cluster version offline is lint's; Helm 4's lint reports a
    # template's `fail` on stderr and goes on (install stops there)
    helm_python.lint(str(OPERATOR_CHART), values, strict=True, namespace="k", kube_version="1.33.0")
    assert "draDriver.enabled: DRA (resource.k8s.io/v1) needs Kubernetes 1.34 or newer" in capfd.readouterr().err
    values["components"]["devicePlugin"]["enabled"] = True
    with pytest.raises(helm_python.HelmRenderError, match="both would hand out the same cards"):
        render(OPERATOR_CHART, values)


def test_helm_test_waits_for_the_dra_driver_to_roll_out():
    values = _dra_values(CASES["gaudi"])
    everything = objects(OPERATOR_CHART, values, name="rel")
    (pod,) = [o for o in everything if o["kind"] == "Pod" and o not in installed([o])]
    waited = {a for c in pod["spec"]["initContainers"] for a in c["args"] if a.startswith("daemonset/")}
    daemonsets = {f"daemonset/{o['metadata']['name']}" for o in installed(everything) if o["kind"] == "DaemonSet"}
    assert waited == daemonsets == {f"daemonset/{manifests.DRA_DRIVER_NAME}"}
