"""render-components with the DRA driver: what it renders, the 1.34 floor, and the DeviceClass's
selector evaluated (cel-python) on slices the driver builds."""

from __future__ import annotations

import celpy
import kubernetes_validate
import pytest

from kubetune.cluster import manifests
from kubetune.cluster.devices.discovery import HEALTHY, UNHEALTHY, Card
from kubetune.cluster.dra.slices import build_slices
from kubetune.contracts import dra
from kubetune.errors import UserError
from kubetune.k8s.validate import validate_objects


def _render(**settings) -> list[dict]:
    return manifests.render(manifests.ComponentSettings(**settings))


def _kinds(objects: list[dict]) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objects}


@pytest.mark.parametrize("discovery", ["sysfs", pytest.param("nvml", marks=pytest.mark.slow)])
def test_dra_components_validate_on_every_dra_release(discovery):
    objects = _render(devices="dra", kubernetes_version="1.34", discovery=discovery)
    assert validate_objects(objects) == []
    for obj in objects:
        if obj["apiVersion"] in ("resource.k8s.io/v1", "apps/v1", "rbac.authorization.k8s.io/v1"):
            for version in ("1.34", "1.37"):
                kubernetes_validate.validate(obj, version, strict=True)
    kinds = _kinds(objects)
    vendor = dra.VENDORS[manifests.DRA_VENDOR[discovery]]
    assert f"DeviceClass/{vendor.device_class}" in kinds
    assert not any(name.startswith("DaemonSet/" + manifests.PLUGIN_NAME) for name in kinds)
    assert not any(o["kind"] == "PodMonitor" for o in objects)  # the driver serves no metrics


def test_dra_daemonset_mounts_the_kubelet_dirs_at_their_paths_with_rbac_for_slices():
    kinds = _kinds(_render(devices="dra"))
    pod = kinds[f"DaemonSet/{manifests.DRA_DRIVER_NAME}"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    hosts = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    assert (
        mounts
        == hosts
        == {
            "plugins-registry": "/var/lib/kubelet/plugins_registry",
            "plugins": "/var/lib/kubelet/plugins",
            "cdi": "/var/run/cdi",
        }
    )
    args = container["args"]
    assert args[0] == "dra-driver" and args[args.index("--cdi-dir") + 1] == "/var/run/cdi"
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
    assert fields == {"NODE_NAME": "spec.nodeName", "POD_UID": "metadata.uid"}
    assert pod["priorityClassName"] == "system-node-critical"
    plugin_pod = _kinds(_render())[f"DaemonSet/{manifests.PLUGIN_NAME}"]["spec"]["template"]["spec"]
    assert pod["affinity"] == plugin_pod["affinity"]  # the nodes today's components run on
    rules = kinds[f"ClusterRole/{manifests.DRA_DRIVER_NAME}"]["rules"]
    verbs = {(r["apiGroups"][0], res): set(r["verbs"]) for r in rules for res in r["resources"]}
    assert verbs == {
        ("resource.k8s.io", "resourceslices"): {"get", "list", "watch", "create", "update", "patch", "delete"},
        ("resource.k8s.io", "resourceclaims"): {"get"},
        ("", "nodes"): {"get"},
    }


def test_dra_is_refused_before_1_34_and_older_clusters_keep_the_device_plugin():
    with pytest.raises(UserError, match=r"--devices dra: DRA \(resource.k8s.io/v1\) needs Kubernetes 1.34"):
        _render(devices="dra", kubernetes_version="1.33")
    old = _kinds(_render(kubernetes_version="v1.30.4"))
    assert f"DaemonSet/{manifests.PLUGIN_NAME}" in old and not any(k.startswith("DeviceClass/") for k in old)
    with pytest.raises(UserError, match="--devices 'cdi': use plugin"):
        _render(devices="cdi")
    with pytest.raises(UserError, match="--kubernetes-version='latest' is not a Kubernetes version"):
        _render(kubernetes_version="latest")


def _cel_device(driver: str, entry: dict) -> dict:
    """A slice's device as a selector sees it: attributes and capacity grouped by domain
    (a bare name is in the driver's domain)."""
    attributes: dict[str, dict] = {}
    for name, value in entry["attributes"].items():
        domain, _, short = name.rpartition("/")
        attributes.setdefault(domain or driver, {})[short] = next(iter(value.values()))
    return {"driver": driver, "attributes": attributes}


@pytest.mark.parametrize("vendor", list(dra.VENDORS.values()), ids=list(dra.VENDORS))
def test_device_class_selects_this_drivers_healthy_cards(vendor):
    cards = [Card(id=f"c{i}", model="m", index=i, pcie_root="pci0000:00") for i in range(2)]
    (s,) = build_slices("n", vendor, cards, {"c0": HEALTHY, "c1": UNHEALTHY}, 1)
    (selector,) = manifests.device_class(vendor)["spec"]["selectors"]
    env = celpy.Environment()
    program = env.program(env.compile(selector["cel"]["expression"]))
    picked = [
        d["name"]
        for d in s["spec"]["devices"]
        if program.evaluate({"device": celpy.json_to_cel(_cel_device(s["spec"]["driver"], d))})
    ]
    assert picked == [s["spec"]["devices"][0]["name"]]
    other = next(v for v in dra.VENDORS.values() if v is not vendor)
    foreign = _cel_device(other.driver, s["spec"]["devices"][0])
    assert not program.evaluate({"device": celpy.json_to_cel(foreign)})
